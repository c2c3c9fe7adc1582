"""Streaming a role's weights out in the `rlhf.weights` wire format, for inference engines.

Every rank of the role runs these together (ZeRO-3 and FSDP2 gather a parameter collectively):
rank 0 packs what `Backend.named_full_parameters` yields into buckets as they fill, the other
ranks only take part in the gathers. No rank ever holds the full state dict: beside the model
there is at most one gathered parameter and one bucket.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from rlhf.learner.backend import Backend
from rlhf.weights import WeightBucket, iter_buckets


def stream_weights(
    backend: Backend,
    *,
    version: int,
    bucket_bytes: int,
    device: torch.device | str | None = None,
    algorithm: str | None = None,
) -> Iterator[WeightBucket]:
    """Rank 0: the role's weights (checkpoint names, LoRA merged) as buckets of at most
    ``bucket_bytes``, each yielded as soon as it is full (headers carry ``total=None``).
    Other ranks: drive the gathers and yield nothing. See `rlhf.weights.iter_buckets` for
    ``device`` (where buffers are built, e.g. ``"cuda"`` for CUDA IPC) and ``algorithm``."""
    params = backend.named_full_parameters()
    if backend.rank != 0:
        for _ in params:
            pass
        return
    yield from iter_buckets(
        params, version=version, bucket_bytes=bucket_bytes, device=device, algorithm=algorithm
    )


class Sender(Protocol):
    """An `rlhf.weights` transport's sender (``ObjectStoreSender``, ``SharedMemorySender``,
    ``CudaIpcSender``, a rank-0 ``BroadcastGroup``)."""

    def send(self, buckets: Any) -> Any: ...


def send_weights(
    backend: Backend,
    sender: Sender | None,
    *,
    version: int,
    bucket_bytes: int,
    device: torch.device | str | None = None,
) -> Any:
    """On every rank: stream the weights into ``sender`` (needed on rank 0 only); returns what
    the sender returns (the sync to hand to the engines) on rank 0, None elsewhere."""
    buckets = stream_weights(backend, version=version, bucket_bytes=bucket_bytes, device=device)
    if backend.rank != 0:
        for _ in buckets:
            pass
        return None
    if sender is None:
        raise ValueError("send_weights needs a sender on rank 0")
    return sender.send(buckets)
