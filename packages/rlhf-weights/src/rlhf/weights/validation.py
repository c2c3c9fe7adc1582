"""Checking a whole sync before anything of it is loaded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlhf.weights.checksums import CHECKSUMS, span_digests
from rlhf.weights.format import DTYPES, WeightBucket, WeightSyncError, as_uint8


def _listed(names: list[str]) -> str:
    return f"{names[:8]}{' …' if len(names) > 8 else ''}"


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
        expected: Checkpoint names → (shape, dtype) the receiver's model holds; None skips
            the name/shape checks.
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
    total = next(iter(totals))
    if len(totals) != 1 or total is None or indices != list(range(total)):
        raise WeightSyncError(
            f"incomplete or duplicated buckets: got indices {indices} of totals "
            f"{sorted(totals, key=str)}"
        )
    seen: dict[str, int] = {}
    bad_sums, bad_bounds, bad_dtypes, unknown, wrong_shape = [], [], [], [], []
    for b in buckets:
        if b.checksum_algorithm not in CHECKSUMS:
            raise WeightSyncError(
                f"bucket {b.index} uses unknown checksum algorithm {b.checksum_algorithm!r}; "
                f"known: {sorted(CHECKSUMS)}"
            )
        raw = as_uint8(b.buffer)
        checked = []  # tensors whose checksums can be computed: known dtype, inside the bucket
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
            checked.append(t)
            if expected is not None:
                if t.name not in expected:
                    unknown.append(t.name)
                elif tuple(expected[t.name][0]) != tuple(t.shape):
                    wrong_shape.append(f"{t.name} {tuple(t.shape)} != {tuple(expected[t.name][0])}")
        spans = [(t.offset, t.nbytes) for t in checked]
        whole, parts = span_digests(raw, spans if check_every_tensor else [], b.checksum_algorithm)
        corrupted = raw.numel() != b.header.nbytes or whole != b.checksum
        if corrupted and not check_every_tensor:
            parts = span_digests(raw, spans, b.checksum_algorithm)[1]
        first_bad = len(bad_sums)
        if corrupted or check_every_tensor:
            pairs = zip(checked, parts, strict=True)
            bad_sums.extend(t.name for t, part in pairs if part != t.checksum)
        if corrupted:
            here = bad_sums[first_bad:]
            named = f"; tensors that differ: {_listed(here)}" if here else ""
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
    found = [f"{what}: {_listed(names)}" for what, names in problems if names]
    if found:
        raise WeightSyncError("weight sync rejected; " + "; ".join(found))
    return next(iter(versions))
