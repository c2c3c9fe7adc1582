"""Ray object store transport: buffers as NumPy arrays in the object store, headers beside
their object refs. Works across the nodes of a Ray cluster; on one node a reader gets a
zero-copy, read-only view. Needs ``rlhf-weights[ray]``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlhf.weights.format import BucketHeader, WeightBucket, WeightSyncError, as_uint8
from rlhf.weights.registry import TransportSpec, register

if TYPE_CHECKING:
    import numpy as np
    from ray import ObjectRef


@dataclass(frozen=True)
class ObjectStoreSync:
    """A sync in the object store.

    Attributes:
        headers: One per bucket, in order, each announcing the number of buckets.
        refs: The object ref of each bucket's (N,) uint8 NumPy buffer, same order.
    """

    headers: tuple[BucketHeader, ...]
    refs: tuple[ObjectRef[np.ndarray], ...]


class ObjectStoreSender:
    """Puts each bucket's buffer into the object store as it arrives (a streaming sender
    holds one bucket at a time); the object store keeps them while a ref is alive."""

    def send(self, buckets: Iterable[WeightBucket]) -> ObjectStoreSync:
        import ray

        headers, refs = [], []
        for b in buckets:
            data = as_uint8(b.buffer)
            refs.append(ray.put((data if data.device.type == "cpu" else data.cpu()).numpy()))
            headers.append(b.header)
        total = len(headers)
        return ObjectStoreSync(
            headers=tuple(h.with_total(total) for h in headers),
            refs=tuple(refs),
        )

    def close(self) -> None:
        """Nothing to release: the buffers live as long as the sync's refs."""


class ObjectStoreReceiver:
    """Fetches a sync's buffers (blocking; an async caller runs it in a thread)."""

    def receive(self, sync: ObjectStoreSync) -> list[WeightBucket]:
        import ray

        if len(sync.headers) != len(sync.refs):
            raise WeightSyncError(
                f"object-store sync has {len(sync.headers)} headers but {len(sync.refs)} refs"
            )
        buffers = ray.get(list(sync.refs))
        return [h.with_buffer(buf) for h, buf in zip(sync.headers, buffers, strict=True)]

    def close(self) -> None:
        """Nothing to release."""


SPEC = register(
    TransportSpec(
        name="object_store",
        reach="cluster",
        devices=frozenset({"cpu", "cuda"}),
        rejoinable=True,  # the last sync's buffers live while its refs do
        auto={"cpu": 1, "cuda": 1},
        sender=ObjectStoreSender,
        receiver=ObjectStoreReceiver,
        sync_type=ObjectStoreSync,
    )
)
