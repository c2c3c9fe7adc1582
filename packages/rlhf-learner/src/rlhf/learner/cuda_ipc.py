"""CUDA IPC sender: a sync whose bucket buffers stay in this process's GPU memory, for engines
on the same GPU (colocated/hybrid placement).

`share_cuda_ipc` takes `iter_buckets` output built on a CUDA device and returns the plain-data
sync that ``rlhf.rollout``'s receiver opens (``{"headers", "handles", "device_uuid"}``: the
bucket headers, ``torch.multiprocessing.reductions.reduce_tensor`` of each buffer, and the GPU's
UUID so a receiver with another ``CUDA_VISIBLE_DEVICES`` numbering finds it). The buffers must
stay alive and unchanged until every receiver has loaded them: keep the returned `CudaIpcShare`
until then. Nothing crosses the host; ``wsum64`` checksums are computed where the bytes are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CudaIpcShare:
    """A sync shared by CUDA IPC.

    Attributes:
        sync: Picklable plain data to hand to the receivers.
        buffers: The shared (N,) uint8 CUDA buffers; drop them only after every receiver loaded.
    """

    sync: dict[str, Any]
    buffers: list[torch.Tensor] = field(default_factory=list)


def share_cuda_ipc(pairs: Iterable[tuple[dict[str, Any], torch.Tensor]]) -> CudaIpcShare:
    """Share ``(header, buffer)`` pairs from `iter_buckets` (buffers on one CUDA device).

    Headers yielded with ``"total": None`` get the number of buckets.

    Raises:
        ValueError: no bucket, a buffer that is not a 1-D uint8 CUDA tensor, or buffers on
            different GPUs (one sync is shared from one GPU).
    """
    from torch.multiprocessing.reductions import reduce_tensor

    headers, buffers = [], []
    for header, buffer in pairs:
        if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(
                f"bucket {header.get('index')}: CUDA IPC shares 1-D uint8 CUDA buffers, got "
                f"{buffer.dtype} of shape {tuple(buffer.shape)} on {buffer.device}; build the "
                "buckets with iter_buckets(..., device='cuda')"
            )
        headers.append(dict(header))
        buffers.append(buffer)
    if not buffers:
        raise ValueError("a CUDA IPC sync needs at least one bucket")
    devices = {b.device for b in buffers}
    if len(devices) != 1:
        raise ValueError(f"a CUDA IPC sync is shared from one GPU, got buffers on {devices}")
    for header in headers:
        if header.get("total") is None:
            header["total"] = len(headers)
    uuid = str(torch.cuda.get_device_properties(buffers[0].device).uuid)
    sync = {
        "headers": headers,
        "handles": [reduce_tensor(b) for b in buffers],
        "device_uuid": uuid,
    }
    return CudaIpcShare(sync=sync, buffers=buffers)
