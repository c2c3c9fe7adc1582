"""Streaming a role's weights out in the `rlhf.weights` wire format, for inference engines.

Every rank of the role runs these together (ZeRO-3 and FSDP2 gather a parameter collectively):
rank 0 packs what `Backend.named_full_parameters` yields into buckets as they fill, the other
ranks only take part in the gathers. No rank ever holds the full state dict: beside the model
there is at most one gathered parameter and one bucket.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from rlhf.learner.backend import Backend
from rlhf.weights import Measured, Sender, WeightBucket, iter_buckets, transport


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


def send_weights(
    backend: Backend,
    sender: Sender | None,
    *,
    version: int,
    bucket_bytes: int,
    device: torch.device | str | None = None,
) -> object:
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


@dataclass(frozen=True)
class SentWeights:
    """Rank 0's send of one sync.

    Attributes:
        sync: What the sender returned: the sync to hand to the engines (a sync-object
            transport), or a group transport's count of buckets sent.
        seconds: Packing and sending, on this rank.
        metrics: The sender's account of the sync (`rlhf.weights.Measured`: a delta sender's
            bytes and changed fraction); empty for others.
    """

    sync: object
    seconds: float
    metrics: Mapping[str, float] = field(default_factory=dict)


class RankSenders:
    """One rank's ends of the `rlhf.weights` transports, by transport name: rank 0 makes its
    sender from the registry on first use (a group transport's when its group forms) and keeps
    it while it must outlive a sync (a shared-memory segment, CUDA IPC buffers until the
    engines loaded, a group's membership); the other ranks only take part in the gathers."""

    def __init__(self) -> None:
        self.open: dict[str, Sender] = {}

    def send(self, backend: Backend, *, kind: str, version: int, bucket_bytes: int) -> SentWeights:
        """Every rank: stream the weights into rank 0's ``kind`` sender; what it sent, and the
        seconds this rank spent packing and sending (without the call that brought it here)."""
        tick = time.perf_counter()
        spec = transport(kind)
        if backend.rank == 0 and kind not in self.open:
            if spec.sender is None:
                raise RuntimeError(f"the {kind} group must form (new_group, join) before a send")
            self.open[kind] = spec.sender()
        device = backend.device if spec.on_device else None
        sender = self.open.get(kind)
        synced = send_weights(
            backend, sender, version=version, bucket_bytes=bucket_bytes, device=device
        )
        metrics = sender.metrics() if isinstance(sender, Measured) else {}
        return SentWeights(synced, time.perf_counter() - tick, metrics)

    def close(self, kind: str) -> None:
        """Release ``kind``'s sender (leave its group)."""
        sender = self.open.pop(kind, None)
        if sender is not None:
            sender.close()

    def new_group(self, backend: Backend, *, kind: str, world_size: int, host: str) -> object:
        """Rank 0: the spec of a new ``kind`` group of ``world_size`` members on this rank's
        device (``host``: this node's address); other ranks: None."""
        spec = transport(kind)
        if backend.rank != 0:
            return None
        assert spec.new_group is not None, f"{kind} is not a group transport"
        return spec.new_group(world_size=world_size, device=backend.device, host=host)

    def join(self, backend: Backend, *, kind: str, group: object) -> None:
        """Rank 0: join ``group`` as its sender (member 0), leaving a former one first."""
        if backend.rank != 0:
            return
        spec = transport(kind)
        assert spec.join is not None, f"{kind} is not a group transport"
        self.close(kind)
        self.open[kind] = spec.join(group, rank=0, device=backend.device)
