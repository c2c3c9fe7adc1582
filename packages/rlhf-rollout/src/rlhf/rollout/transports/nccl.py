"""NCCL transport through CuPy's NCCL bindings (receiver half): engines on other GPUs.

The learner's sender is rank 0 of a NCCL group that holds one rank per engine (ranks 1..N).
It creates the group's unique id (``cupy.cuda.nccl.get_unique_id()``), hands it to every
engine, and all ranks build their communicator at the same time (construction blocks until
every rank has joined). A sync is then: the sender tells each engine the bucket headers, and
broadcasts each bucket's buffer from rank 0; each engine receives into fresh uint8 buffers on
its GPU, validates the whole sync there (``wsum64`` checksums are torch ops on the GPU) and
loads it.

CuPy's NCCL is used instead of ``torch.distributed`` so that an engine's group with the
learner never collides with the process groups vLLM and the learner set up for themselves.
Install CuPy for the machine's CUDA (``cupy-cuda12x`` or ``cupy-cuda13x``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlhf.rollout.buckets import BucketHeader, WeightBucket, WeightSyncError, header_from_wire


def _nccl() -> Any:
    try:
        from cupy.cuda import nccl  # pyright: ignore[reportMissingImports]
    except ImportError as exc:
        raise ImportError(
            "the NCCL weight transport needs CuPy with NCCL: pip install cupy-cuda12x "
            "(or cupy-cuda13x, matching the machine's CUDA)"
        ) from exc
    return nccl


def new_unique_id() -> tuple[int, ...]:
    """A NCCL unique id for a new group (made by rank 0, sent to every other rank)."""
    return tuple(_nccl().get_unique_id())


class NcclGroup:
    """One rank of a NCCL group on this process's current (or given) CUDA device.

    Args:
        unique_id: From `new_unique_id` on rank 0.
        rank: This rank; 0 is the sender.
        world_size: Ranks in the group (1 + number of receiving engines).
        device: CUDA device of this rank (default: the current one).
    """

    def __init__(
        self,
        *,
        unique_id: Sequence[int],
        rank: int,
        world_size: int,
        device: torch.device | int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        nccl = _nccl()
        import cupy  # pyright: ignore[reportMissingImports]

        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world_size = rank, world_size
        with cupy.cuda.Device(self.device.index):
            self._comm = nccl.NcclCommunicator(world_size, tuple(unique_id), rank)
        self._uint8 = nccl.NCCL_UINT8

    def broadcast(self, buffer: torch.Tensor, *, root: int = 0) -> None:
        """In-place broadcast of a contiguous uint8 CUDA tensor from ``root`` (blocks until
        done on this rank's current stream)."""
        if buffer.device != self.device or buffer.dtype != torch.uint8:
            raise ValueError(f"broadcast needs a uint8 tensor on {self.device}, got {buffer.dtype}")
        stream = torch.cuda.current_stream(self.device)
        self._comm.bcast(buffer.data_ptr(), buffer.numel(), self._uint8, root, stream.cuda_stream)

    def send_buckets(self, buckets: Sequence[WeightBucket]) -> None:
        """Rank 0: broadcast the CUDA buffers of ``buckets`` in order (the engines must be
        receiving the same headers)."""
        for b in buckets:
            if not isinstance(b.buffer, torch.Tensor):
                raise TypeError(f"bucket {b.index}: the NCCL transport needs a CUDA uint8 buffer")
            self.broadcast(b.buffer.to(self.device))
        torch.cuda.current_stream(self.device).synchronize()

    def receive_buckets(
        self, headers: Sequence[BucketHeader | Mapping[str, Any]]
    ) -> list[WeightBucket]:
        """Ranks > 0: receive one buffer per header from rank 0, in order."""
        if self.rank == 0:
            raise WeightSyncError("rank 0 is the sender of the group; it does not receive")
        parsed = [header_from_wire(h) for h in headers]
        buckets = []
        for h in parsed:
            buffer = torch.empty(h.nbytes, dtype=torch.uint8, device=self.device)
            self.broadcast(buffer)
            buckets.append(h.with_buffer(buffer))
        torch.cuda.current_stream(self.device).synchronize()
        return buckets

    def close(self) -> None:
        """Destroy the communicator."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()
