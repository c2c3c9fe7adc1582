"""Host transports: POSIX shared memory and the Ray object store.

Shared memory: the sender copies every bucket into one segment (buckets 64-byte aligned) and
hands the receiver a `SharedMemorySync` (segment name + headers + offsets); the receiver maps
the segment and loads straight from it, no copy. The sender owns the segment and unlinks it
when its context ends.

Object store: `put_buckets` stores each bucket with its buffer as a NumPy array, which Ray
hands to a reader on the same node as a zero-copy read-only view.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from rlhf.rollout.buckets import BucketHeader, WeightBucket, as_uint8

_ALIGN = 64


@dataclass(frozen=True)
class SharedMemorySync:
    """What the receiver needs to map a sync written into shared memory.

    Attributes:
        name: Shared-memory segment name.
        headers: One per bucket.
        offsets: Byte offset of each bucket's buffer in the segment.
    """

    name: str
    headers: tuple[BucketHeader, ...]
    offsets: tuple[int, ...]


@contextlib.contextmanager
def send_shared_memory(buckets: Sequence[WeightBucket]) -> Iterator[SharedMemorySync]:
    """Write ``buckets`` into a new segment; yield its description; unlink it on exit."""
    offsets, size = [], 0
    for b in buckets:
        size = -(-size // _ALIGN) * _ALIGN
        offsets.append(size)
        size += b.nbytes
    shm = shared_memory.SharedMemory(create=True, size=max(size, 1))
    try:
        dst = torch.frombuffer(shm.buf, dtype=torch.uint8)
        for b, off in zip(buckets, offsets, strict=True):
            src = as_uint8(b.buffer)
            dst[off : off + src.numel()].copy_(src)
        del dst
        yield SharedMemorySync(shm.name, tuple(b.header() for b in buckets), tuple(offsets))
    finally:
        shm.close()
        shm.unlink()


@contextlib.contextmanager
def receive_shared_memory(sync: SharedMemorySync) -> Iterator[list[WeightBucket]]:
    """Map the segment of ``sync`` and yield its buckets (views into it) for the block's length.

    Tensors made from the buckets must not outlive the block (the loader copies them into the
    model)."""
    shm = shared_memory.SharedMemory(name=sync.name)
    # The sender owns the segment: keep this process's resource tracker from unlinking it.
    with contextlib.suppress(Exception):
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    view = shm.buf
    try:
        if view is None or any(
            o + h.nbytes > len(view) for h, o in zip(sync.headers, sync.offsets, strict=True)
        ):
            raise ValueError(f"shared-memory segment {sync.name!r} is smaller than its sync")
        yield [
            h.with_buffer(view[o : o + h.nbytes])
            for h, o in zip(sync.headers, sync.offsets, strict=True)
        ]
    finally:
        del view
        with contextlib.suppress(BufferError):  # a caller kept a view: unmapped when collected
            shm.close()


def put_buckets(buckets: Sequence[WeightBucket]) -> list[Any]:
    """Store each bucket in the Ray object store; returns its object refs in bucket order."""
    import ray

    return [ray.put(_with_numpy_buffer(b)) for b in buckets]


def _with_numpy_buffer(bucket: WeightBucket) -> WeightBucket:
    data = as_uint8(bucket.buffer)
    if data.device.type != "cpu":
        data = data.cpu()
    return bucket.header().with_buffer(data.numpy())
