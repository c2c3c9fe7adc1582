"""ZeRO-3's fp32 master partitions and Adam moments off the device and back, with any torch
optimizer.

DeepSpeed's ZeRO-3 ``offload_states`` moves the bf16 partitions, the gradient partitions and
the reduce buckets with any optimizer, but refuses the two largest states (``hp_params``: the
fp32 master partitions; ``optim_states``: Adam's moments) unless the optimizer is its compiled
FusedAdam. Those two moves are plain re-links of tensor storage (``tensor.data = host copy``)
that do not depend on the optimizer's kernels, so `MasterOffload` does them for the torch
AdamW the learners use: the same tensor objects stay in the optimizer's param groups and state,
only their storage moves, so the next step is bit-identical to one without the round trip.

Per trained rank with P parameters and R data-parallel ranks the two states are 4 P / R bytes
(master) and 8 P / R bytes (two fp32 moments): two thirds of what ZeRO-3 keeps on the device
under bf16 training, the rest being the 2 P / R bytes of bf16 partitions DeepSpeed moves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

#: The names DeepSpeed's ``OffloadStateTypeEnum`` gives the two states moved here.
MASTER = "hp_params"
MOMENTS = "optim_states"
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


class MasterOffload:
    """Moves a ZeRO-3 optimizer's master partitions and Adam moments to host memory and back.

    Args:
        zero_optimizer: DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3`` (``engine.optimizer``):
            its ``fp32_partitioned_groups_flat`` are the master partitions (1-D float32, one per
            param group), its ``optimizer`` the torch optimizer whose state holds the moments
            (1-D float32 of the same lengths).
    """

    def __init__(self, zero_optimizer: Any) -> None:
        self._zero = zero_optimizer
        # Host buffers (pinned on CUDA) by the id of the tensor they hold, made at its first
        # offload and reused after: the master partitions and the moments are the same tensor
        # objects for the optimizer's life (the moments appear at its first step).
        self._host: dict[int, torch.Tensor] = {}
        self._device: torch.device | None = None
        self.offloaded: set[str] = set()

    def _tensors(self) -> Iterator[torch.Tensor]:
        yield from self._zero.fp32_partitioned_groups_flat
        for per_param in self._zero.optimizer.state.values():
            yield from (per_param[key] for key in MOMENT_KEYS if key in per_param)

    def offload(self, *, device: torch.device, pin_memory: bool) -> None:
        """Both states' tensors on ``device`` (the rank's) to host memory (idempotent): each
        one's storage becomes its host buffer. States already on the host
        (``deepspeed.offload_optimizer``) stay where they are; on a CPU rank the storage
        still moves to the buffers, as it would on a GPU."""
        if self.offloaded:
            return
        self._device = device
        for tensor in self._tensors():
            if tensor.device != device:
                continue
            buffer = self._host.get(id(tensor))
            if buffer is None or (buffer.shape, buffer.dtype) != (tensor.shape, tensor.dtype):
                # (another shape: a tensor made since, e.g. by a checkpoint load, under a
                # freed one's id)
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin_memory)
                self._host[id(tensor)] = buffer
            buffer.copy_(tensor)
            tensor.data = buffer
        self.offloaded = {MASTER, MOMENTS}

    def reload(self) -> None:
        """Undo `offload` (a no-op when nothing is off the device)."""
        if not self.offloaded:
            return
        assert self._device is not None
        for tensor in self._tensors():
            buffer = self._host.get(id(tensor))
            if buffer is not None and tensor.data_ptr() == buffer.data_ptr():
                tensor.data = tensor.data.to(self._device)
        self.offloaded = set()
