"""Weight sending: a model's parameters as a sync in the bucket wire format (ARCHITECTURE.md §3).

The receiver (``rlhf.rollout``) defines the format; this is the sender, written against its
documented plain-data form so the two packages never import each other::

    header = {"version", "index", "total", "nbytes", "checksum", "checksum_algorithm",
              "tensors": [[name, dtype, [dims], offset, checksum], ...]}

plus one flat uint8 buffer per bucket. Tensors sit at 64-byte aligned offsets. Checksums:
``crc32`` of host bytes (zlib, with the byte length) or ``wsum64``, position-weighted int64
word sums computed with torch ops where the buffer lives (GPU buffers are never copied to be
checked). An end-to-end test in the CLI holds sender and receiver to the same bytes.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

ALIGN = 64
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


def _crc32(data: torch.Tensor) -> str:
    host = data.cpu().contiguous() if data.device.type != "cpu" else data.contiguous()
    n = host.numel()
    view = memoryview((ctypes.c_uint8 * n).from_address(host.data_ptr())) if n else b""
    return f"{n:x}-{zlib.crc32(view):08x}"


_CHUNK = 1 << 24


def _wsum64(data: torch.Tensor) -> str:
    n = data.numel()
    pad = (-n) % 8
    if pad:
        data = torch.cat([data, torch.zeros(pad, dtype=torch.uint8, device=data.device)])
    elif data.storage_offset() % 8:
        data = data.clone()
    words = data.view(torch.int64) if data.numel() else data.new_zeros(0, dtype=torch.int64)
    s1 = torch.zeros((), dtype=torch.int64, device=data.device)
    s2 = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK]
        weights = torch.arange(chunk.numel(), dtype=torch.int64, device=data.device)
        weights.mul_(2).add_(2 * start + 1)
        s1 += chunk.sum()
        s2 += (chunk * weights).sum()
    mask = (1 << 64) - 1
    return f"{n:x}-{int(s1.item()) & mask:016x}{int(s2.item()) & mask:016x}"


CHECKSUMS: dict[str, Callable[[torch.Tensor], str]] = {"crc32": _crc32, "wsum64": _wsum64}


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int,
    total: int | None,
    algorithm: str | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    """Pack tensors, in order, into buckets of at most ``bucket_bytes``; yield each bucket
    as soon as it is full, as ``(header, buffer)``.

    Streaming keeps at most one bucket in memory beside the model (ZeRO-3 gathers one
    parameter at a time). Every header carries ``total``, the number of buckets: pass it when
    known in advance (`count_buckets` of the byte sizes), or None to get headers with
    ``"total": None`` that the caller fills in once the last bucket is out.

    Args:
        named_tensors: ``(checkpoint name, tensor)``.
        version: Weight version of the sync.
        bucket_bytes: Bucket size; a larger tensor gets a bucket of its own.
        total: `count_buckets` of the same sizes and ``bucket_bytes``, or None (see above).
        algorithm: ``crc32`` or ``wsum64``; default ``wsum64`` on CUDA, else ``crc32``.
        device: Where buffers are built (default: each bucket's first tensor's device).
    """
    index = 0
    pending: list[tuple[str, torch.Tensor, int]] = []
    size = 0
    for name, tensor in named_tensors:
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no wire name")
        nbytes = tensor.numel() * tensor.element_size()
        offset = -(-size // ALIGN) * ALIGN
        if pending and offset + nbytes > bucket_bytes:
            yield _bucket(pending, version, index, total, algorithm, device)
            index += 1
            pending, offset = [], 0
        pending.append((name, tensor.detach(), offset))
        size = offset + nbytes
    if pending:
        yield _bucket(pending, version, index, total, algorithm, device)
        index += 1
    if total is not None and index != total:
        raise ValueError(f"packed {index} buckets but total={total} was announced")


def count_buckets(sizes: Iterable[int], bucket_bytes: int) -> int:
    """Buckets `iter_buckets` makes from tensors of these byte sizes."""
    count, size, started = 0, 0, False
    for nbytes in sizes:
        offset = -(-size // ALIGN) * ALIGN
        if not started or offset + nbytes > bucket_bytes:
            count += 1
            offset = 0
            started = True
        size = offset + nbytes
    return count


def _bucket(
    pending: list[tuple[str, torch.Tensor, int]],
    version: int,
    index: int,
    total: int | None,
    algorithm: str | None,
    device: torch.device | str | None,
) -> tuple[dict[str, Any], torch.Tensor]:
    where = torch.device(device) if device is not None else pending[0][1].device
    name_of_algorithm = algorithm or ("wsum64" if where.type == "cuda" else "crc32")
    digest = CHECKSUMS[name_of_algorithm]
    _, last, last_offset = pending[-1]
    buffer = torch.zeros(
        last_offset + last.numel() * last.element_size(), dtype=torch.uint8, device=where
    )
    tensors = []
    for name, tensor, offset in pending:
        raw = tensor.to(where).contiguous().view(-1).view(torch.uint8)
        view = buffer[offset : offset + raw.numel()]
        view.copy_(raw)
        tensors.append([name, DTYPE_NAMES[tensor.dtype], list(tensor.shape), offset, digest(view)])
    header = {
        "version": version,
        "index": index,
        "total": total,
        "nbytes": buffer.numel(),
        "checksum": digest(buffer),
        "checksum_algorithm": name_of_algorithm,
        "tensors": tensors,
    }
    return header, buffer
