"""Checksums of bucket and tensor bytes, by name.

``crc32`` (host bytes; zlib, the fastest on a CPU), ``blake2b-128`` (host bytes) and
``wsum64`` (computed with torch ops where the bytes live, so a GPU buffer is never copied to
the host to be checked). They guard against corruption in transit and against mixed-up
buffers, not against an adversary.
"""

from __future__ import annotations

import ctypes
import hashlib
import zlib
from collections.abc import Callable

import torch

from rlhf.weights.format import Buffer, as_uint8


def _host_view(data: torch.Tensor) -> memoryview:
    """The bytes of a uint8 tensor as a memoryview (copied to the host if on a device)."""
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    if data.numel() == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_uint8 * data.numel()).from_address(data.data_ptr())).cast("B")


def _blake2b_128(data: torch.Tensor) -> str:
    """BLAKE2b with a 16-byte digest over the bytes (host memory)."""
    return hashlib.blake2b(_host_view(data), digest_size=16).hexdigest()


def _crc32(data: torch.Tensor) -> str:
    """CRC-32 of the bytes (host memory; ~3x faster than BLAKE2b on a CPU) with the length."""
    return f"{data.numel():x}-{zlib.crc32(_host_view(data)):08x}"


_WSUM_CHUNK = 1 << 24  # int64 words per step: bounds the temporary index tensor to 128 MiB


def _wsum64(data: torch.Tensor) -> str:
    """Position-weighted sums of the little-endian int64 words, modulo 2**64, on ``data``'s
    device.

    ``s1 = sum(w_i)``, ``s2 = sum((2 i + 1) * w_i)`` over the buffer zero-padded to a multiple
    of 8 bytes, and the byte length: a reordering, flipped bit or truncation changes the
    digest. Integer sums are exact and order-free, so every device computes the same value.
    """
    n = data.numel()
    pad = (-n) % 8
    if pad:
        data = torch.cat([data, torch.zeros(pad, dtype=torch.uint8, device=data.device)])
    elif data.storage_offset() % 8:
        data = data.clone()  # int64 views need 8-byte aligned storage
    words = data.view(torch.int64) if data.numel() else data.new_zeros(0, dtype=torch.int64)
    s1 = torch.zeros((), dtype=torch.int64, device=data.device)
    s2 = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), _WSUM_CHUNK):
        chunk = words[start : start + _WSUM_CHUNK]
        weights = torch.arange(chunk.numel(), dtype=torch.int64, device=data.device)
        weights.mul_(2).add_(2 * start + 1)
        s1 += chunk.sum()
        s2 += (chunk * weights).sum()
    mask = (1 << 64) - 1
    return f"{n:x}-{int(s1.item()) & mask:016x}{int(s2.item()) & mask:016x}"


CHECKSUMS: dict[str, Callable[[torch.Tensor], str]] = {
    "blake2b-128": _blake2b_128,
    "crc32": _crc32,
    "wsum64": _wsum64,
}
"""Checksum algorithms by name; each maps a 1-D uint8 tensor to a hex digest string."""


def digest_of(algorithm: str) -> Callable[[torch.Tensor], str]:
    """The function of ``algorithm``; `ValueError` listing the known names otherwise."""
    try:
        return CHECKSUMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown checksum algorithm {algorithm!r}; known: {sorted(CHECKSUMS)}"
        ) from None


def checksum(data: Buffer, algorithm: str = "blake2b-128") -> str:
    """Digest of ``data`` (bytes-like or a uint8 tensor) with one of `CHECKSUMS`."""
    return digest_of(algorithm)(as_uint8(data))


def default_algorithm(device: torch.device) -> str:
    """``wsum64`` where the bytes are on a GPU (no copy to the host), else ``crc32``."""
    return "wsum64" if device.type == "cuda" else "crc32"
