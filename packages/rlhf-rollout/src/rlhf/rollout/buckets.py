"""The weight-sync wire format (ARCHITECTURE.md §3), receiver side: decoding and validation.

A sync is an ordered list of `WeightBucket` objects sharing one ``version``. Each bucket holds
one flat byte buffer and the metadata of the tensors packed into it: ``(name, dtype, shape,
offset, checksum)`` with ``offset`` in bytes into the buffer. The bucket carries a checksum of
its whole buffer; each tensor carries one of its own bytes, so a mismatch names the parameter.
Checksums are BLAKE2b-128 hex digests. Names are checkpoint (Hugging Face) names, as the
learner's ``state_dict`` spells them; vLLM's loader maps them onto its fused parameters.

The sender half (packing a learner's parameters into buckets) lives in ``rlhf.learner``; the two
meet only through this format.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

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


def checksum(data: bytes | memoryview) -> str:
    """BLAKE2b-128 hex digest of ``data``."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor sits in its bucket.

    Attributes:
        name: Checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        dtype: A key of `DTYPES`.
        shape: Tensor shape.
        offset: Byte offset into the bucket's buffer.
        checksum: Digest of the tensor's bytes.
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
        buffer: The packed bytes.
        checksum: Digest of ``buffer``.
    """

    version: int
    index: int
    total: int
    tensors: tuple[TensorMeta, ...]
    buffer: bytes
    checksum: str


class WeightSyncError(ValueError):
    """A sync was rejected; the engine keeps serving its previous weights."""


def validate_sync(
    buckets: Sequence[WeightBucket],
    *,
    expected: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
    require_all: bool = True,
) -> int:
    """Check a whole sync before anything is loaded; return its version.

    Args:
        buckets: The sync, in any order.
        expected: Checkpoint names → (shape, dtype) the engine's model holds; None skips the
            name/shape checks.
        require_all: Every expected parameter must be present (a full sync).

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
        if checksum(b.buffer) != b.checksum:
            raise WeightSyncError(
                f"bucket {b.index} of version {b.version} is corrupted (checksum mismatch)"
            )
        for t in b.tensors:
            if t.name in seen:
                raise WeightSyncError(
                    f"parameter {t.name!r} appears in buckets {seen[t.name]} and {b.index}"
                )
            seen[t.name] = b.index
            if t.dtype not in DTYPES:
                bad_dtypes.append(f"{t.name} ({t.dtype})")
                continue
            if t.offset < 0 or t.offset + t.nbytes > len(b.buffer):
                bad_bounds.append(t.name)
                continue
            if checksum(memoryview(b.buffer)[t.offset : t.offset + t.nbytes]) != t.checksum:
                bad_sums.append(t.name)
            if expected is not None:
                if t.name not in expected:
                    unknown.append(t.name)
                elif tuple(expected[t.name][0]) != tuple(t.shape):
                    wrong_shape.append(f"{t.name} {tuple(t.shape)} != {tuple(expected[t.name][0])}")
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


def iter_tensors(buckets: Sequence[WeightBucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a validated sync; tensors are read-only views."""
    for b in sorted(buckets, key=lambda b: b.index):
        raw = (
            torch.frombuffer(bytearray(b.buffer), dtype=torch.uint8)
            if b.buffer
            else torch.empty(0, dtype=torch.uint8)
        )
        for t in b.tensors:
            flat = raw[t.offset : t.offset + t.nbytes]
            yield t.name, flat.view(DTYPES[t.dtype]).view(t.shape)
