"""``--actor.fsdp.offload optimizer``: AdamW on the host, against float32 host masters.

The device keeps this rank's parameter shards (what forwards gather) and their gradients; the
host keeps a float32 copy of each trainable shard (the master) and AdamW's two moments for it.
A step takes one parameter at a time: its (already clipped) gradient shard to the host, AdamW
on its master there, the updated master back into the device shard. The device never holds
optimizer state, which is 8 of the 16 bytes a float32-trained parameter costs under AdamW, and
the host holds 12 bytes per parameter (master and moments) plus one parameter's gradient:
copying every gradient first would add 4 bytes per parameter at the step's peak (measured:
an 8.8B-parameter model's step ran out of 125 GiB of host memory that way).

Checkpoints keep the layout of `torch.distributed.checkpoint.state_dict.get_state_dict`
(``state.<fqn>.exp_avg`` as DTensors sharded like the parameter, ``param_groups`` with
parameter names), so a checkpoint written with the optimizer offloaded resumes without it and
the other way round, and on another rank count (DCP reshards).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf.learner.config import OptimizerConfig
from rlhf.learner.optim import build_optimizer

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(param: Tensor, local: Tensor) -> Tensor:
    """``local`` (a host tensor shaped like this rank's shard of ``param``) as a DTensor
    sharded as ``param`` is; a plain tensor stays plain."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local,
        device_mesh=param.device_mesh,
        placements=param.placements,
        shape=param.shape,
        stride=param.stride(),
        run_check=False,
    )


class HostAdamW:
    """AdamW and its schedule over host masters of ``named_params``' shards.

    Args:
        named_params: ``(fqn, parameter)`` of every trainable parameter (DTensor shards).
        config: The optimizer settings (`rlhf.learner.OptimizerConfig`).

    Attributes:
        optimizer: The torch AdamW over the masters (its ``param_groups`` carry the lr).
        scheduler: Its LambdaLR schedule.
    """

    def __init__(
        self, named_params: Sequence[tuple[str, torch.nn.Parameter]], config: OptimizerConfig
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.masters = torch.nn.ParameterList()
        for param in self.params:
            # Pageable, not pinned: torch's pinned allocator rounds each block up to a power of
            # two, one block per tensor: 1.9x the masters' bytes at a 7B width (an 8.8B
            # model's masters and moments then no longer fitted 125 GiB of host memory).
            host = _local(param).detach().to("cpu", dtype=torch.float32, copy=True)
            self.masters.append(torch.nn.Parameter(host))
        self.optimizer, self.scheduler = build_optimizer(self.masters, config)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self) -> None:
        """Per parameter: its gradient shard to the host, AdamW on its master (torch's AdamW
        steps only the parameters that have a gradient, and counts each one's steps itself),
        the master back to the shard, the host gradient dropped."""
        for param, master in zip(self.params, self.masters, strict=True):
            grad = param.grad
            if grad is None:
                continue
            master.grad = _local(grad).to("cpu", dtype=torch.float32)
            self.optimizer.step()
            master.grad = None
            with torch.no_grad():
                local = _local(param)
                local.copy_(master.to(local.device, dtype=local.dtype, non_blocking=True))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            param.grad = None
            master.grad = None

    # -- checkpoints (get_state_dict's layout) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}``
        with the moments as DTensors sharded like their parameters."""
        state: dict[str, Any] = {}
        for name, param, master in zip(self.names, self.params, self.masters, strict=True):
            held = self.optimizer.state.get(master)
            if held:
                state[name] = {"step": held["step"]}
                state[name].update({k: _like(param, held[k]) for k in _MOMENTS})
        index = {id(m): n for n, m in zip(self.names, self.masters, strict=True)}
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [index[id(p)] for p in g["params"]],
            }
            for g in self.optimizer.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def empty_state(self) -> dict[str, Any]:
        """The ``state`` part of `state_dict` with zero moments, to load a checkpoint into."""
        state = {}
        for name, param, master in zip(self.names, self.params, self.masters, strict=True):
            state[name] = {"step": torch.zeros((), dtype=torch.float32)}
            state[name].update({k: _like(param, torch.zeros_like(master)) for k in _MOMENTS})
        return {"state": state}

    def load(self, loaded: dict[str, Any]) -> None:
        """Adopt what `empty_state` was filled with, and take the masters from the
        parameters (load the model and the scheduler first: the learning rate follows the
        schedule)."""
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                master.copy_(_local(param))
        for name, master in zip(self.names, self.masters, strict=True):
            held = loaded["state"][name]
            self.optimizer.state[master] = {
                "step": held["step"].detach().clone().float(),
                **{k: _local(held[k]).detach().to("cpu", dtype=torch.float32) for k in _MOMENTS},
            }
        for group, lr in zip(
            self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True
        ):
            group["lr"] = lr
