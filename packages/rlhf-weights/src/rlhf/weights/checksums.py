"""Checksums of bucket and tensor bytes, by name.

``crc32`` (host bytes; zlib, the fastest on a CPU), ``blake2b-128`` (host bytes) and
``wsum64`` (computed with torch ops where the bytes live, so a GPU buffer is never copied to
the host to be checked). They guard against corruption in transit and against mixed-up
buffers, not against an adversary.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import hashlib
import zlib
from collections.abc import Callable, Sequence

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


# int64 words per step: 128 MiB temporaries, few enough steps that a GPU's time goes to reading
# the bytes, not to launching kernels (H200, 1.26 GB of buckets: 4.6 ms against 9.8 ms at 32 MiB)
_WSUM_CHUNK = 1 << 24
_MASK = (1 << 64) - 1


def _words(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``data`` as little-endian int64 words: the whole words (a view where the storage is
    8-byte aligned), and the trailing ``numel % 8`` bytes zero-padded to one word (None when
    there are none). No copy of the whole buffer is made for an unaligned length."""
    n = data.numel()
    whole = n - n % 8
    if data.storage_offset() % 8:
        data = data.clone()  # int64 views need 8-byte aligned storage
    words = data[:whole].view(torch.int64) if whole else data.new_zeros(0, dtype=torch.int64)
    if whole == n:
        return words, None
    pad = torch.zeros(8 - n % 8, dtype=torch.uint8, device=data.device)
    return words, torch.cat([data[whole:], pad]).view(torch.int64)


@functools.lru_cache(maxsize=8)
def _odd(size: int, device: torch.device) -> torch.Tensor:
    """``2 j + 1`` for ``j < size`` on ``device``: the weights of a chunk, kept per power-of-two
    size (int32, 64 MiB for a full chunk; products with the int64 words are int64)."""
    return torch.arange(size, dtype=torch.int32, device=device).mul_(2).add_(1)


def _wsum64_prefixes(data: torch.Tensor, bounds: list[int]) -> list[tuple[int, int]]:
    """``(P1(k), P2(k))`` modulo 2**64 for each word index ``k`` of sorted ``bounds``:
    ``P1(k) = sum_{j<k} w_j``, ``P2(k) = sum_{j<k} (2 j + 1) w_j`` over the words of
    `_words`; one copy to the host."""
    return [(a & _MASK, b & _MASK) for a, b in _wsum64_prefix_sums(data, bounds).tolist()]


def _wsum64_prefix_sums(data: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """`_wsum64_prefixes` as a ``(len(bounds), 2)`` int64 tensor on ``data``'s device (not
    yet reduced modulo 2**64 to unsigned). Chunk by chunk (sums where no bound falls inside
    a chunk, cumulative sums where one does), without waiting for the device.

    A chunk starting at word ``s`` weighs its words with ``2 (s + i) + 1``, that is the kept
    ``2 i + 1`` plus ``2 s`` times its plain sum."""
    words, tail = _words(data)
    chunks = [words[s : s + _WSUM_CHUNK] for s in range(0, words.numel(), _WSUM_CHUNK)]
    if tail is not None:
        chunks.append(tail)
    device = data.device
    carry = torch.zeros(2, dtype=torch.int64, device=device)
    found = [torch.zeros(sum(1 for k in bounds if k == 0), 2, dtype=torch.int64, device=device)]
    start, i = 0, bisect.bisect_right(bounds, 0)
    for chunk in chunks:
        stop = start + chunk.numel()
        size = min(_WSUM_CHUNK, 1 << max(chunk.numel() - 1, 0).bit_length())
        weighted = chunk * _odd(size, device)[: chunk.numel()]
        j = bisect.bisect_right(bounds, stop)
        inside = bounds[i:j]  # bounds in (start, stop]
        if inside and inside != [stop]:
            sum1, sum2 = chunk.cumsum(0), weighted.cumsum(0)
            at = torch.tensor([k - start - 1 for k in inside], device=device)
            here1 = sum1[at]
            found.append(torch.stack([here1, sum2[at] + 2 * start * here1], dim=1) + carry)
            total1, total2 = sum1[-1], sum2[-1]
        else:
            total1, total2 = chunk.sum(), weighted.sum()
        carry = carry + torch.stack([total1, total2 + 2 * start * total1])
        if inside == [stop]:
            found.append(carry[None])
        start, i = stop, j
    if i < len(bounds):
        raise ValueError(f"word index {bounds[i]} is past the buffer's {start} words")
    return torch.cat(found)


def _wsum64_spans(data: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[str]:
    """`_wsum64` of the whole buffer, then of each ``(offset, nbytes)`` span of it, from one
    pass over the buffer (a span's digest is a difference of prefix sums, its trailing partial
    word masked as the zero padding of `_wsum64` would be)."""
    if any(offset % 8 for offset, _ in spans):
        return [_wsum64(data)] + [_wsum64(data[o : o + n]) for o, n in spans]
    n = data.numel()
    ends = [-(-(o + size) // 8) for o, size in spans]
    bounds = sorted({0, -(-n // 8)} | {o // 8 for o, _ in spans} | set(ends))
    prefixes = dict(zip(bounds, _wsum64_prefixes(data, bounds), strict=True))
    # Bytes of the buffer that share a span's last word but lie past the span: the span's own
    # digest reads them as zeros (rarely any: weights are mostly whole words long).
    past = [
        (i, p) for i, (o, size) in enumerate(spans) for p in range(o + size, min(8 * ends[i], n))
    ]
    values = data[torch.tensor([p for _, p in past], device=data.device)].tolist() if past else []
    extra = dict.fromkeys(range(len(spans)), 0)
    for (i, p), value in zip(past, values, strict=True):
        extra[i] += value << (8 * (p % 8))
    total1, total2 = prefixes[bounds[-1]]
    out = [f"{n:x}-{total1:016x}{total2:016x}"]
    for i, ((offset, size), end) in enumerate(zip(spans, ends, strict=True)):
        first = offset // 8
        s1 = prefixes[end][0] - prefixes[first][0]
        s2 = prefixes[end][1] - prefixes[first][1] - 2 * first * s1
        s1 -= extra[i]
        s2 -= (2 * (end - 1 - first) + 1) * extra[i]
        out.append(f"{size:x}-{s1 & _MASK:016x}{s2 & _MASK:016x}")
    return out


def _wsum64(data: torch.Tensor) -> str:
    """Position-weighted sums of the little-endian int64 words, modulo 2**64, on ``data``'s
    device.

    ``s1 = sum(w_i)``, ``s2 = sum((2 i + 1) * w_i)`` over the buffer zero-padded to a multiple
    of 8 bytes, and the byte length: a reordering, flipped bit or truncation changes the
    digest. Integer sums are exact and order-free, so every device computes the same value.
    """
    return wsum64_each([data])[0]


def wsum64_each(tensors: Sequence[torch.Tensor]) -> list[str]:
    """``wsum64`` of each 1-D uint8 tensor, with one copy to the host per device (on a GPU:
    one synchronisation for all of them, instead of one per tensor)."""
    sums = [_wsum64_prefix_sums(t, [-(-t.numel() // 8)]) for t in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    values: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    for indices in by_device.values():
        rows = torch.cat([sums[i] for i in indices]).tolist()
        for i, (a, b) in zip(indices, rows, strict=True):
            values[i] = (a & _MASK, b & _MASK)
    return [f"{t.numel():x}-{a:016x}{b:016x}" for t, (a, b) in zip(tensors, values, strict=True)]


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


def span_digests(
    data: torch.Tensor, spans: Sequence[tuple[int, int]], algorithm: str
) -> tuple[str, list[str]]:
    """Digest of a 1-D uint8 buffer and of each ``(offset, nbytes)`` span of it, equal to
    ``digest_of(algorithm)`` applied to each. ``wsum64`` with 8-byte aligned spans reads the
    buffer once on its device and copies only the sums to the host (one synchronisation for a
    bucket, instead of two per tensor); the host algorithms read the bytes once each."""
    if algorithm == "wsum64":
        whole, *parts = _wsum64_spans(data, spans)
        return whole, parts
    digest = digest_of(algorithm)
    if data.device.type != "cpu":
        data = data.cpu()
    return digest(data), [digest(data[o : o + n]) for o, n in spans]


def checksum(data: Buffer, algorithm: str = "blake2b-128") -> str:
    """Digest of ``data`` (bytes-like or a uint8 tensor) with one of `CHECKSUMS`."""
    return digest_of(algorithm)(as_uint8(data))


def default_algorithm(device: torch.device) -> str:
    """``wsum64`` where the bytes are on a GPU (no copy to the host), else ``crc32``."""
    return "wsum64" if device.type == "cuda" else "crc32"
