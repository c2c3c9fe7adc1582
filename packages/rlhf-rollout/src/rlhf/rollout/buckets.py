"""The weight-sync wire format (ARCHITECTURE.md §3), receiver side: decoding and validation.

A sync is an ordered list of `WeightBucket` objects sharing one ``version``. Each bucket holds
one flat byte buffer and the metadata of the tensors packed into it: ``(name, dtype, shape,
offset, checksum)`` with ``offset`` in bytes into the buffer. The bucket carries a checksum of
its whole buffer; each tensor carries one of its own bytes, so a mismatch names the parameter.
Names are checkpoint (Hugging Face) names, as the learner's ``named_parameters`` spells them;
vLLM's loader maps them onto its fused parameters.

The buffer is any bytes-like object (host transports: ``bytes``, a shared-memory
``memoryview``, a NumPy array from Ray's object store) or a 1-D ``torch.uint8`` tensor on any
device (CUDA IPC and NCCL transports). Checksums come from `CHECKSUMS`, named per bucket:
``crc32`` (host bytes, the fastest here), ``blake2b-128`` (host bytes) or ``wsum64`` (computed
with torch ops where the buffer lives, so a GPU buffer is never copied to the host to be
checked). They guard against corruption in transit and against mixed-up buffers, not against
an adversary.

`pack_buckets` is a sender for trainers outside rlhf; ``rlhf.learner`` has its own (it gathers
sharded parameters). The two meet only through this format; `BucketHeader.to_wire` is its
plain-data form.
"""

from __future__ import annotations

import ctypes
import hashlib
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

Buffer = bytes | bytearray | memoryview | torch.Tensor | Any
"""A bucket buffer: a bytes-like object or a 1-D ``torch.uint8`` tensor (any device)."""


def as_uint8(buffer: Buffer) -> torch.Tensor:
    """A 1-D ``torch.uint8`` view of ``buffer`` without copying; never write through it."""
    if isinstance(buffer, torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise TypeError(
                f"a tensor bucket buffer must be 1-D uint8, got {buffer.dtype} "
                f"{tuple(buffer.shape)}"
            )
        return buffer
    view = memoryview(buffer).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # Read-only sources (bytes, Ray's object store) are shared, not copied; the loader only
        # reads them.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.frombuffer(view, dtype=torch.uint8)


def _host_view(data: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 tensor as a memoryview (copied to host if on a device)."""
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    if data.numel() == 0:
        return memoryview(b"")
    array = (ctypes.c_uint8 * data.numel()).from_address(data.data_ptr())
    view = memoryview(array).cast("B")
    return view


def _blake2b_128(data: torch.Tensor) -> str:
    """BLAKE2b with a 16-byte digest over the bytes (host memory)."""
    return hashlib.blake2b(_host_view(data), digest_size=16).hexdigest()


def _crc32(data: torch.Tensor) -> str:
    """CRC-32 of the bytes (host memory; zlib, ~3x faster than BLAKE2b here) with the length."""
    return f"{data.numel():x}-{zlib.crc32(_host_view(data)):08x}"


_WSUM_CHUNK = 1 << 24  # int64 words per step: bounds the temporary index tensor to 128 MiB


def _wsum64(data: torch.Tensor) -> str:
    """Position-weighted sums of the little-endian int64 words, modulo 2**64, on ``data``'s device.

    ``s1 = sum(w_i)``, ``s2 = sum((2 i + 1) * w_i)`` over the buffer zero-padded to a multiple of
    8 bytes, and the byte length: a reordering, flipped bit or truncation changes the digest.
    Integer sums are exact and order-free, so every device computes the same value.
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


def checksum(data: Buffer, algorithm: str = "blake2b-128") -> str:
    """Digest of ``data`` (bytes-like or uint8 tensor) with one of `CHECKSUMS`."""
    try:
        fn = CHECKSUMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown checksum algorithm {algorithm!r}; known: {sorted(CHECKSUMS)}"
        ) from None
    return fn(as_uint8(data))


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor sits in its bucket.

    Attributes:
        name: Checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        dtype: A key of `DTYPES`.
        shape: Tensor shape.
        offset: Byte offset into the bucket's buffer.
        checksum: Digest of the tensor's bytes (the bucket's algorithm).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    checksum: str

    @property
    def nbytes(self) -> int:
        """Size of the tensor in bytes."""
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


@dataclass(frozen=True)
class WeightBucket:
    """One bucket of a weight sync.

    Attributes:
        version: Weight version of the whole sync (the same in every bucket).
        index: Position of this bucket, 0-based.
        total: Number of buckets in the sync.
        tensors: Metadata of the tensors in this bucket.
        buffer: The packed bytes (bytes-like, or a 1-D uint8 tensor on any device).
        checksum: Digest of ``buffer``.
        checksum_algorithm: A key of `CHECKSUMS`, used for the bucket and its tensors.
    """

    version: int
    index: int
    total: int
    tensors: tuple[TensorMeta, ...]
    buffer: Buffer
    checksum: str
    checksum_algorithm: str = "blake2b-128"

    @property
    def nbytes(self) -> int:
        """Size of the buffer in bytes."""
        return as_uint8(self.buffer).numel()

    def header(self) -> BucketHeader:
        """The bucket without its buffer (what travels beside a device or shared buffer)."""
        return BucketHeader(
            self.version,
            self.index,
            self.total,
            self.tensors,
            self.nbytes,
            self.checksum,
            self.checksum_algorithm,
        )


@dataclass(frozen=True)
class BucketHeader:
    """A `WeightBucket`'s metadata; transports send it beside the buffer they move.

    Attributes:
        version, index, total, tensors, checksum, checksum_algorithm: as in `WeightBucket`.
        nbytes: Size of the buffer in bytes.
    """

    version: int
    index: int
    total: int
    tensors: tuple[TensorMeta, ...]
    nbytes: int
    checksum: str
    checksum_algorithm: str = "blake2b-128"

    def to_wire(self) -> dict[str, Any]:
        """The header as plain data (`header_from_wire` reads it back).

        This is the cross-package contract: a sender that cannot import ``rlhf.rollout`` (the
        learner) builds these dicts itself::

            {
                "version": int,
                "index": int,
                "total": int,
                "nbytes": int,
                "checksum": str,
                "checksum_algorithm": str,
                "tensors": [[name, dtype, [dim, ...], offset, checksum], ...],
            }
        """
        return {
            "version": self.version,
            "index": self.index,
            "total": self.total,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
            "checksum_algorithm": self.checksum_algorithm,
            "tensors": [
                [t.name, t.dtype, list(t.shape), t.offset, t.checksum] for t in self.tensors
            ],
        }

    def with_buffer(self, buffer: Buffer) -> WeightBucket:
        """The bucket carrying ``buffer`` (which must be ``nbytes`` long)."""
        return WeightBucket(
            self.version,
            self.index,
            self.total,
            self.tensors,
            buffer,
            self.checksum,
            self.checksum_algorithm,
        )


class WeightSyncError(ValueError):
    """A sync was rejected; the engine keeps serving its previous weights."""


_WIRE_KEYS = ("version", "index", "total", "nbytes", "checksum", "checksum_algorithm", "tensors")


def header_from_wire(header: BucketHeader | Mapping[str, Any]) -> BucketHeader:
    """A `BucketHeader` from its plain-data form (`BucketHeader.to_wire`); headers pass through.

    Raises:
        WeightSyncError: naming the missing or malformed field.
    """
    if isinstance(header, BucketHeader):
        return header
    missing = [k for k in _WIRE_KEYS if k not in header]
    if missing:
        raise WeightSyncError(f"bucket header lacks {missing}; it has {sorted(header)}")
    try:
        tensors = tuple(
            TensorMeta(str(n), str(d), tuple(int(x) for x in shape), int(o), str(c))
            for n, d, shape, o, c in header["tensors"]
        )
        return BucketHeader(
            int(header["version"]),
            int(header["index"]),
            int(header["total"]),
            tensors,
            int(header["nbytes"]),
            str(header["checksum"]),
            str(header["checksum_algorithm"]),
        )
    except (TypeError, ValueError) as exc:
        raise WeightSyncError(
            f"malformed bucket header (index {header.get('index')!r}): {exc}; tensors must be "
            "[name, dtype, shape, offset, checksum] entries"
        ) from exc


def bucket_from_wire(item: WeightBucket | tuple[Mapping[str, Any], Buffer]) -> WeightBucket:
    """A `WeightBucket` from a bucket or from a ``(header, buffer)`` pair in plain-data form
    (what ``rlhf.learner``'s sender yields)."""
    if isinstance(item, WeightBucket):
        return item
    if isinstance(item, tuple) and len(item) == 2:
        header, buffer = item
        return header_from_wire(header).with_buffer(buffer)
    raise WeightSyncError(
        f"a sync item must be a WeightBucket or a (header, buffer) pair, got {type(item).__name__}"
    )


def validate_sync(
    buckets: Sequence[WeightBucket],
    *,
    expected: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
    require_all: bool = True,
    check_every_tensor: bool = False,
) -> int:
    """Check a whole sync before anything is loaded; return its version.

    Each bucket's bytes are read once, for its checksum; the tensors' own checksums are
    computed only when that fails, to name the parameters that arrived corrupted (or always,
    with ``check_every_tensor``, which also catches a sender that checksummed a bucket after
    corrupting it).

    Args:
        buckets: The sync, in any order.
        expected: Checkpoint names → (shape, dtype) the engine's model holds; None skips the
            name/shape checks.
        require_all: Every expected parameter must be present (a full sync).
        check_every_tensor: Verify every tensor checksum, not only those of a failed bucket.

    Raises:
        WeightSyncError: naming the buckets or parameters at fault.
    """
    if not buckets:
        raise WeightSyncError("a weight sync needs at least one bucket")
    versions = {b.version for b in buckets}
    if len(versions) != 1:
        raise WeightSyncError(f"buckets disagree on the weight version: {sorted(versions)}")
    totals = {b.total for b in buckets}
    indices = sorted(b.index for b in buckets)
    if len(totals) != 1 or indices != list(range(next(iter(totals)))):
        raise WeightSyncError(
            f"incomplete or duplicated buckets: got indices {indices} of totals {sorted(totals)}"
        )
    seen: dict[str, int] = {}
    bad_sums, bad_bounds, bad_dtypes, unknown, wrong_shape = [], [], [], [], []
    for b in buckets:
        if b.checksum_algorithm not in CHECKSUMS:
            raise WeightSyncError(
                f"bucket {b.index} uses unknown checksum algorithm {b.checksum_algorithm!r}; "
                f"known: {sorted(CHECKSUMS)}"
            )
        digest = CHECKSUMS[b.checksum_algorithm]
        raw = as_uint8(b.buffer)
        corrupted = digest(raw) != b.checksum
        first_bad = len(bad_sums)
        for t in b.tensors:
            if t.name in seen:
                raise WeightSyncError(
                    f"parameter {t.name!r} appears in buckets {seen[t.name]} and {b.index}"
                )
            seen[t.name] = b.index
            if t.dtype not in DTYPES:
                bad_dtypes.append(f"{t.name} ({t.dtype})")
                continue
            if t.offset < 0 or t.offset + t.nbytes > raw.numel():
                bad_bounds.append(t.name)
                continue
            if (corrupted or check_every_tensor) and digest(
                raw[t.offset : t.offset + t.nbytes]
            ) != t.checksum:
                bad_sums.append(t.name)
            if expected is not None:
                if t.name not in expected:
                    unknown.append(t.name)
                elif tuple(expected[t.name][0]) != tuple(t.shape):
                    wrong_shape.append(f"{t.name} {tuple(t.shape)} != {tuple(expected[t.name][0])}")
        if corrupted:
            here = bad_sums[first_bad:]
            named = (
                f"; tensors that differ: {here[:8]}{' …' if len(here) > 8 else ''}" if here else ""
            )
            raise WeightSyncError(
                f"bucket {b.index} of version {b.version} is corrupted (checksum mismatch){named}"
            )
    problems = [
        ("unknown dtypes", bad_dtypes),
        ("tensors outside their bucket", bad_bounds),
        ("checksum mismatches", bad_sums),
        ("names the model does not have", unknown),
        ("wrong shapes", wrong_shape),
    ]
    if expected is not None and require_all:
        problems.append(("missing parameters", sorted(set(expected) - set(seen))))
    found = [
        f"{what}: {names[:8]}{' …' if len(names) > 8 else ''}" for what, names in problems if names
    ]
    if found:
        raise WeightSyncError("weight sync rejected; " + "; ".join(found))
    return next(iter(versions))


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int,
    algorithm: str | None = None,
    align: int = 64,
) -> list[WeightBucket]:
    """Pack tensors into a sync (the sender's side, for trainers outside rlhf).

    Tensors are taken in order and packed into buckets of at most ``bucket_bytes`` (a larger
    tensor gets a bucket of its own), each at an offset aligned to ``align`` bytes so the
    receiver views them without copying. Buffers are 1-D uint8 tensors on the tensors' device
    (a GPU sender packs and checksums on the GPU; use ``wsum64`` there). ``rlhf.learner`` has
    its own sender (it gathers sharded parameters); both write this format.

    Args:
        named_tensors: ``(checkpoint name, tensor)`` pairs, all on one device.
        version: Weight version of the sync.
        bucket_bytes: Target bucket size.
        algorithm: A key of `CHECKSUMS`; default ``wsum64`` for CUDA tensors, else ``crc32``.
        align: Byte alignment of each tensor in its bucket (a multiple of 8).

    Returns:
        The buckets, indices 0..total-1.
    """
    if bucket_bytes < 1 or align < 8 or align % 8:
        raise ValueError(
            f"need bucket_bytes >= 1 and align a multiple of 8, got {bucket_bytes}, {align}"
        )
    named_tensors = list(named_tensors)
    if algorithm is None:
        on_gpu = bool(named_tensors) and named_tensors[0][1].device.type == "cuda"
        algorithm = "wsum64" if on_gpu else "crc32"
    if algorithm not in CHECKSUMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {sorted(CHECKSUMS)}")
    digest = CHECKSUMS[algorithm]
    groups: list[list[tuple[str, torch.Tensor, int]]] = []
    size = 0
    for name, tensor in named_tensors:
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"{name}: dtype {tensor.dtype} has no wire name; known {sorted(DTYPES)}"
            )
        offset = -(-size // align) * align
        nbytes = tensor.numel() * tensor.element_size()
        if not groups or (offset + nbytes > bucket_bytes and groups[-1]):
            groups.append([])
            offset = 0
        groups[-1].append((name, tensor, offset))
        size = offset + nbytes
    packed = []
    for index, group in enumerate(groups):
        _, last, last_offset = group[-1]
        device = last.device
        buffer = torch.zeros(
            last_offset + last.numel() * last.element_size(), dtype=torch.uint8, device=device
        )
        metas = []
        for name, tensor, offset in group:
            raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
            view = buffer[offset : offset + raw.numel()]
            view.copy_(raw)
            metas.append(
                TensorMeta(
                    name, _DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), offset, digest(view)
                )
            )
        packed.append(
            WeightBucket(
                version, index, len(groups), tuple(metas), buffer, digest(buffer), algorithm
            )
        )
    return packed


def iter_tensors(buckets: Sequence[WeightBucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a validated sync: views into the buffers, on the
    buffers' device; read them, never write them."""
    for b in sorted(buckets, key=lambda b: b.index):
        raw = as_uint8(b.buffer)
        for t in b.tensors:
            flat = raw[t.offset : t.offset + t.nbytes]
            if flat.storage_offset() % DTYPES[t.dtype].itemsize:
                flat = flat.clone()  # a sender that did not align this tensor costs one copy
            yield t.name, flat.view(DTYPES[t.dtype]).view(t.shape)
