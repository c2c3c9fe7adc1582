"""CUDA IPC transport (receiver half): buckets that stay in the sender's GPU memory.

A colocated sender (a learner process on the same GPU) packs each bucket into one uint8 CUDA
tensor and shares it with ``torch.multiprocessing.reductions.reduce_tensor``, which yields
``(rebuild_fn, args)``: an IPC memory handle plus what is needed to rebuild the tensor. It sends
a `CudaIpcSync` (or its plain-data form, a dict with the same keys) with the bucket headers
and the UUID of its GPU, and keeps the tensors alive until the receiver has loaded them.

The receiver opens the handles on the GPU with that UUID, whatever index that GPU has in its
own ``CUDA_VISIBLE_DEVICES``, validates the sync where the bytes are (``wsum64`` checksums run
as torch ops on the GPU) and loads from the mapped memory: nothing crosses the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.rollout.buckets import BucketHeader, WeightBucket, WeightSyncError, header_from_wire

# Position of the device index in torch's ``rebuild_cuda_tensor`` arguments (torch >= 2.0).
_DEVICE_ARG = 6


@dataclass(frozen=True)
class CudaIpcSync:
    """A sync shared by CUDA IPC.

    Attributes:
        headers: One per bucket (`BucketHeader` or its `BucketHeader.to_wire` dict).
        handles: ``reduce_tensor(buffer)`` of each bucket's 1-D uint8 CUDA buffer, same order.
        device_uuid: ``str(torch.cuda.get_device_properties(i).uuid)`` of the sender's GPU.
    """

    headers: tuple[BucketHeader | Mapping[str, Any], ...]
    handles: tuple[tuple[Any, tuple[Any, ...]], ...]
    device_uuid: str


def device_index_of(uuid: str) -> int:
    """This process's CUDA index of the GPU with ``uuid``.

    Raises:
        WeightSyncError: when no visible GPU has it (sender and receiver are not colocated).
    """
    seen = []
    for i in range(torch.cuda.device_count()):
        own = str(torch.cuda.get_device_properties(i).uuid)
        if own == uuid:
            return i
        seen.append(own)
    raise WeightSyncError(
        f"CUDA IPC sync from GPU {uuid}, which this process cannot see (visible: {seen}); "
        "CUDA IPC needs the sender and the engine on the same GPU: use the NCCL transport"
    )


def receive_cuda_ipc(sync: CudaIpcSync | Mapping[str, Any]) -> list[WeightBucket]:
    """Open the shared buffers of ``sync``; the buckets view the sender's memory.

    The sender must keep its buffers alive (and unchanged) until the receiver has loaded them.
    """
    if isinstance(sync, Mapping):
        try:
            sync = CudaIpcSync(
                tuple(sync["headers"]), tuple(sync["handles"]), str(sync["device_uuid"])
            )
        except KeyError as exc:
            raise WeightSyncError(f"CUDA IPC sync lacks {exc}") from None
    headers = [header_from_wire(h) for h in sync.headers]
    if len(headers) != len(sync.handles):
        raise WeightSyncError(
            f"CUDA IPC sync has {len(headers)} headers but {len(sync.handles)} handles"
        )
    index = device_index_of(sync.device_uuid)
    buckets = []
    for header, (rebuild, args) in zip(headers, sync.handles, strict=True):
        local = list(args)
        local[_DEVICE_ARG] = index
        buffer = rebuild(*local)
        if buffer.numel() != header.nbytes:
            raise WeightSyncError(
                f"bucket {header.index}: shared buffer holds {buffer.numel()} bytes, its header "
                f"says {header.nbytes}"
            )
        buckets.append(header.with_buffer(buffer))
    return buckets


def share_cuda_ipc(buckets: Sequence[WeightBucket]) -> CudaIpcSync:
    """The sender's side, for a sender that has `WeightBucket` objects with CUDA buffers
    (tests, tools; ``rlhf.learner`` has its own). Keep ``buckets`` alive until loaded."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = []
    for b in buckets:
        if not isinstance(b.buffer, torch.Tensor) or b.buffer.device.type != "cuda":
            raise TypeError(f"bucket {b.index}: CUDA IPC needs a CUDA uint8 buffer")
        handles.append(reduce_tensor(b.buffer))
    device = buckets[0].buffer.device if buckets else torch.device("cuda")
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return CudaIpcSync(tuple(b.header() for b in buckets), tuple(handles), uuid)
