"""Packing tensors into buckets (the sender's side) and viewing them again (the receiver's).

`iter_buckets` streams: it yields each bucket as soon as it is full, so a sender that gathers
sharded parameters one at a time (ZeRO-3, FSDP2) never holds more than one bucket beside the
model. `pack_buckets` is the same as a list, with every bucket's ``total`` known.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from rlhf.weights.checksums import default_algorithm, digest_of, span_digests
from rlhf.weights.format import (
    ALIGN,
    DTYPE_NAMES,
    DTYPES,
    BucketHeader,
    TensorMeta,
    WeightBucket,
    as_uint8,
)


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int,
    total: int | None = None,
    algorithm: str | None = None,
    device: torch.device | str | None = None,
) -> Iterator[WeightBucket]:
    """Pack tensors, in order, into buckets of at most ``bucket_bytes``; yield each bucket as
    soon as the next tensor would not fit.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own. Each tensor sits at an
    offset aligned to `ALIGN` bytes; the padding is zeros. A tensor yielded by
    ``named_tensors`` is copied into its bucket before the next one is requested, so a
    gathering sender may reuse its memory.

    Args:
        named_tensors: ``(checkpoint name, tensor)`` pairs.
        version: Weight version of the sync.
        bucket_bytes: Bucket size (>= 1).
        total: `count_buckets` of the same sizes, announced in every header; None leaves
            ``total`` None (the sender fills it in with `WeightBucket.with_total`).
        algorithm: A key of `CHECKSUMS`; default ``wsum64`` for buckets on a GPU, else
            ``crc32``.
        device: Where buffers are built (default: each bucket's first tensor's device).

    Yields:
        `WeightBucket` objects with (N,) uint8 tensor buffers, indices 0, 1, ...

    Raises:
        ValueError: a dtype without a wire name, or ``total`` that turned out wrong.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if algorithm is not None:
        digest_of(algorithm)  # fail before any tensor is packed
    index = 0
    pending: list[tuple[str, torch.Tensor, int]] = []
    size = 0
    for name, tensor in named_tensors:
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no wire name; known {list(DTYPES)}")
        nbytes = tensor.numel() * tensor.element_size()
        offset = _aligned(size)
        if pending and offset + nbytes > bucket_bytes:
            yield _bucket(pending, version, index, total, algorithm, device)
            index += 1
            pending, offset = [], 0
        # The bucket copies the tensor only when it is built: keep it alive until then.
        pending.append((name, tensor.detach(), offset))
        size = offset + nbytes
    if pending:
        yield _bucket(pending, version, index, total, algorithm, device)
        index += 1
    if total is not None and index != total:
        raise ValueError(f"packed {index} buckets but total={total} was announced")


def _bucket(
    pending: list[tuple[str, torch.Tensor, int]],
    version: int,
    index: int,
    total: int | None,
    algorithm: str | None,
    device: torch.device | str | None,
) -> WeightBucket:
    where = torch.device(device) if device is not None else pending[0][1].device
    name_of_algorithm = algorithm or default_algorithm(where)
    _, last, last_offset = pending[-1]
    buffer = torch.zeros(
        last_offset + last.numel() * last.element_size(), dtype=torch.uint8, device=where
    )
    spans = []
    for _, tensor, offset in pending:
        raw = tensor.to(where).contiguous().view(-1).view(torch.uint8)
        buffer[offset : offset + raw.numel()].copy_(raw)
        spans.append((offset, raw.numel()))
    # Every digest from one pass over the finished bucket (on a GPU: one synchronisation).
    whole, parts = span_digests(buffer, spans, name_of_algorithm)
    metas = tuple(
        TensorMeta(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), offset, part)
        for (name, tensor, offset), part in zip(pending, parts, strict=True)
    )
    header = BucketHeader(
        version=version,
        index=index,
        total=total,
        tensors=metas,
        nbytes=buffer.numel(),
        checksum=whole,
        checksum_algorithm=name_of_algorithm,
    )
    return WeightBucket(header, buffer)


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int,
    algorithm: str | None = None,
    device: torch.device | str | None = None,
) -> list[WeightBucket]:
    """`iter_buckets` as a list whose headers announce the number of buckets."""
    buckets = list(
        iter_buckets(
            named_tensors,
            version=version,
            bucket_bytes=bucket_bytes,
            algorithm=algorithm,
            device=device,
        )
    )
    return [b.with_total(len(buckets)) for b in buckets]


def count_buckets(sizes: Iterable[int], bucket_bytes: int) -> int:
    """Buckets `iter_buckets` makes from tensors of these byte sizes."""
    count, size = 0, 0
    for nbytes in sizes:
        offset = _aligned(size)
        if not count or offset + nbytes > bucket_bytes:
            count += 1
            offset = 0
        size = offset + nbytes
    return count


def iter_tensors(buckets: Sequence[WeightBucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of a validated sync: views into the buffers, on the
    buffers' device; read them, never write them."""
    for b in sorted(buckets, key=lambda b: b.index):
        raw = as_uint8(b.buffer)
        for t in b.tensors:
            flat = raw[t.offset : t.offset + t.nbytes]
            if flat.storage_offset() % DTYPES[t.dtype].itemsize:
                flat = flat.clone()  # a sender that did not align this tensor costs one copy
            yield t.name, flat.view(DTYPES[t.dtype]).view(t.shape)
