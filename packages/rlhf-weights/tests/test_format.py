"""The wire format by hand: bucket layout, checksums, the plain-data headers, streaming and
whole-sync validation."""

from __future__ import annotations

import hashlib
import json
import zlib

import pytest
import torch

from rlhf.weights import (
    CHECKSUMS,
    BucketHeader,
    WeightSyncError,
    checksum,
    count_buckets,
    iter_buckets,
    iter_tensors,
    pack_buckets,
    span_digests,
    validate_sync,
    wsum64_each,
)


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(10, 7, generator=gen),
        "b.bias": torch.randn(3, generator=gen).to(torch.bfloat16),
        "c.weight": torch.randn(40, generator=gen),
        "d": torch.arange(5),
    }


def test_layout_offsets_and_checksums_by_hand() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])  # 12 bytes at offset 0
    b = torch.tensor([7, 8], dtype=torch.int64)  # 16 bytes at the next 64-byte boundary
    c = torch.ones(5, dtype=torch.bfloat16)  # 10 bytes: 64 + 16 + pad to 128 + 10 > 120
    b0, b1 = pack_buckets(
        [("a", a), ("b", b), ("c", c)], version=4, bucket_bytes=120, algorithm="blake2b-128"
    )
    assert [(t.name, t.offset, t.dtype, t.shape) for t in b0.tensors] == [
        ("a", 0, "float32", (3,)),
        ("b", 64, "int64", (2,)),
    ]
    assert [(t.name, t.offset, t.dtype) for t in b1.tensors] == [("c", 0, "bfloat16")]
    assert (b0.index, b0.total, b1.index, b1.total, b0.version) == (0, 2, 1, 2, 4)
    raw = b0.buffer.numpy().tobytes()
    assert len(raw) == 80 and raw[12:64] == bytes(52)  # padding is zeros
    assert raw[:12] == a.numpy().tobytes() and raw[64:80] == b.numpy().tobytes()
    assert b0.tensors[1].checksum == hashlib.blake2b(raw[64:80], digest_size=16).hexdigest()
    assert b0.checksum == hashlib.blake2b(raw, digest_size=16).hexdigest()
    # A tensor larger than the bucket size gets a bucket of its own.
    big = pack_buckets([("a", a), ("z", torch.zeros(100)), ("b", b)], version=1, bucket_bytes=64)
    assert [[t.name for t in x.tensors] for x in big] == [["a"], ["z"], ["b"]]
    with pytest.raises(ValueError, match="dtype torch.complex64 has no wire name"):
        pack_buckets([("w", torch.zeros(2, dtype=torch.complex64))], version=1, bucket_bytes=64)


def test_streamed_buckets_reassemble_with_crc32_digests_by_hand() -> None:
    s = state()
    sizes = [t.numel() * t.element_size() for t in s.values()]
    total = count_buckets(sizes, 300)
    buckets = list(iter_buckets(s.items(), version=3, bucket_bytes=300, total=total))
    # a: 280 bytes | b: 6 at 0, c: 160 at 64, d: 40 at 256 → 296 <= 300.
    assert len(buckets) == total == 2
    assert [[t.offset for t in b.tensors] for b in buckets] == [[0], [0, 64, 256]]
    for b in buckets:
        raw = b.buffer.numpy().tobytes()
        assert b.checksum_algorithm == "crc32"  # the default for host buffers
        assert b.header.nbytes == len(raw)
        assert b.checksum == f"{len(raw):x}-{zlib.crc32(raw):08x}"
        for t in b.tensors:
            piece = raw[t.offset : t.offset + t.nbytes]
            assert t.checksum == f"{len(piece):x}-{zlib.crc32(piece):08x}"
    back = dict(iter_tensors(buckets))
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in s.items())
    with pytest.raises(ValueError, match="announced"):
        list(iter_buckets(s.items(), version=3, bucket_bytes=300, total=3))
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        list(iter_buckets(s.items(), version=3, bucket_bytes=0))
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        list(iter_buckets(s.items(), version=3, bucket_bytes=300, algorithm="md5"))


def test_iter_buckets_yields_before_reading_the_rest() -> None:
    """A gathering sender hands out one tensor at a time: the first bucket must be out before
    the tensor that overflows it is followed by any other."""
    asked: list[str] = []

    def tensors():
        for name in ("a", "b", "c"):
            asked.append(name)
            yield name, torch.zeros(16)  # 64 bytes each

    stream = iter_buckets(tensors(), version=1, bucket_bytes=64)
    first = next(stream)
    assert [t.name for t in first.tensors] == ["a"] and asked == ["a", "b"]
    assert first.total is None  # unknown until the stream ends
    assert [b.index for b in stream] == [1, 2]


def test_wsum64_by_hand() -> None:
    # Words (little endian) 1 and 2 after zero padding of 9 bytes to 16: s1 = 3, s2 = 1·1 + 3·2.
    data = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 2], dtype=torch.uint8)
    assert CHECKSUMS["wsum64"](data) == f"9-{3:016x}{7:016x}"
    # Swapping the two words keeps s1 and changes s2: 1·2 + 3·1.
    swapped = torch.tensor([2, 0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8)
    assert checksum(swapped, "wsum64") == f"9-{3:016x}{5:016x}"
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        checksum(b"x", "sha1")


def _wsum64_from_the_definition(data: bytes) -> str:
    """s1 = sum(w_i), s2 = sum((2 i + 1) w_i) mod 2**64 over little-endian 8-byte words of the
    bytes zero-padded to a multiple of 8, with the byte length."""
    padded = data + bytes(-len(data) % 8)
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    s1 = sum(words) % 2**64
    s2 = sum((2 * i + 1) * w for i, w in enumerate(words)) % 2**64
    return f"{len(data):x}-{s1:016x}{s2:016x}"


@pytest.mark.parametrize("chunk", [3, 1 << 22])
def test_span_digests_of_one_pass_equal_each_spans_own(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bucket read once in chunks of `chunk` words (3: spans cross chunk edges) must give
    # every span the digest of its bytes alone: aligned spans of every length mod 8, spans
    # that end where the buffer ends mid-word, empty spans, non-zero bytes between spans.
    import rlhf.weights.checksums as checksums

    monkeypatch.setattr(checksums, "_WSUM_CHUNK", chunk)
    gen = torch.Generator().manual_seed(1)
    for n, spans in [
        (0, []),
        (13, [(0, 13)]),
        (13, [(0, 10)]),
        (64, [(0, 8), (8, 0), (16, 5), (24, 40)]),
        (101, [(0, 3), (8, 17), (32, 1), (40, 61)]),
        (200, [(8 * i, 7) for i in range(25)]),
    ]:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        whole, parts = span_digests(data, spans, "wsum64")
        raw = bytes(data.tolist())
        assert whole == _wsum64_from_the_definition(raw)
        assert parts == [_wsum64_from_the_definition(raw[o : o + k]) for o, k in spans]
        # Unaligned spans and the host algorithms give the same as one digest per span.
        shifted = [(o + 1, max(k - 1, 0)) for o, k in spans]
        assert span_digests(data, shifted, "wsum64")[1] == [
            _wsum64_from_the_definition(raw[o : o + k]) for o, k in shifted
        ]
        assert span_digests(data, spans, "crc32") == (
            checksum(data, "crc32"),
            [checksum(data[o : o + k], "crc32") for o, k in spans],
        )
    # A buffer that does not start on an 8-byte boundary of its storage.
    base = torch.randint(0, 256, (40,), dtype=torch.uint8, generator=gen)
    whole, parts = span_digests(base[3:], [(8, 9)], "wsum64")
    assert whole == _wsum64_from_the_definition(bytes(base[3:].tolist()))
    assert parts == [_wsum64_from_the_definition(bytes(base[11:20].tolist()))]


@pytest.mark.parametrize("chunk", [3, 1 << 22])
def test_wsum64_each_equals_each_tensors_own_digest(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Many tensors digested with one copy to the host: each equals the definition, whatever
    # its length (empty, partial last word, several chunks) or its storage offset.
    import rlhf.weights.checksums as checksums

    monkeypatch.setattr(checksums, "_WSUM_CHUNK", chunk)
    gen = torch.Generator().manual_seed(2)
    base = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=gen)
    tensors = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (0, 1, 13, 64, 101)
    ] + [base[5:40]]
    assert wsum64_each(tensors) == [_wsum64_from_the_definition(bytes(t.tolist())) for t in tensors]
    assert wsum64_each([]) == []


def test_headers_survive_json_and_rebuild_a_valid_sync() -> None:
    s = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(4)}
    buckets = pack_buckets(s.items(), version=3, bucket_bytes=24)
    assert len(buckets) == 2
    wire = json.loads(json.dumps([b.header.to_wire() for b in buckets]))
    headers = [BucketHeader.from_wire(w) for w in wire]
    assert headers == [b.header for b in buckets]
    rebuilt = [h.with_buffer(b.buffer) for h, b in zip(headers, buckets, strict=True)]
    expected = {"a.weight": ((2, 3), "float32"), "b.bias": ((4,), "float32")}
    assert validate_sync(rebuilt, expected=expected) == 3
    assert BucketHeader.from_wire(headers[0]) is headers[0]


def test_malformed_wire_headers_name_the_problem() -> None:
    (bucket,) = pack_buckets([("a.weight", torch.ones(2))], version=1, bucket_bytes=64)
    wire = bucket.header.to_wire()
    with pytest.raises(WeightSyncError, match=r"bucket header lacks \['nbytes'\]"):
        BucketHeader.from_wire({k: v for k, v in wire.items() if k != "nbytes"})
    with pytest.raises(WeightSyncError, match=r"malformed bucket header \(index 0\)"):
        BucketHeader.from_wire({**wire, "tensors": [["a.weight", "float32", [2]]]})
    with pytest.raises(WeightSyncError, match=r"malformed bucket header"):
        BucketHeader.from_wire({**wire, "version": "seven"})


def _corrupt(bucket, *, at: int = 0):
    raw = bytearray(bucket.buffer.numpy().tobytes())
    raw[at] ^= 0xFF
    return bucket.header.with_buffer(torch.frombuffer(raw, dtype=torch.uint8))


def test_validation_names_what_is_wrong() -> None:
    s = state()
    buckets = pack_buckets(s.items(), version=2, bucket_bytes=300)
    expected = {k: (tuple(v.shape), "float32") for k, v in s.items()}
    assert validate_sync(buckets, expected=expected) == 2
    with pytest.raises(WeightSyncError, match=r"bucket 0 of version 2 is corrupted.*a\.weight"):
        validate_sync([_corrupt(buckets[0]), buckets[1]])
    with pytest.raises(WeightSyncError, match=r"incomplete or duplicated buckets.*\[1\]"):
        validate_sync(buckets[1:])
    with pytest.raises(WeightSyncError, match="incomplete"):  # a stream's unfinished headers
        validate_sync(list(iter_buckets(s.items(), version=2, bucket_bytes=300)))
    other = pack_buckets(s.items(), version=5, bucket_bytes=300)
    with pytest.raises(WeightSyncError, match="disagree on the weight version"):
        validate_sync([buckets[0], other[1]])
    with pytest.raises(WeightSyncError, match=r"missing parameters: \['e'\]"):
        validate_sync(buckets, expected={**expected, "e": ((1,), "float32")})
    assert validate_sync(buckets, expected={**expected, "e": ((1,), "x")}, require_all=False)
    with pytest.raises(WeightSyncError, match=r"wrong shapes: \['d \(5,\) != \(6,\)'\]"):
        validate_sync(buckets, expected={**expected, "d": ((6,), "int64")})
    with pytest.raises(WeightSyncError, match=r"names the model does not have: \['d'\]"):
        validate_sync(buckets, expected={k: v for k, v in expected.items() if k != "d"})
    with pytest.raises(WeightSyncError, match="needs at least one bucket"):
        validate_sync([])
    # A bucket checksummed after a tensor was damaged: only the per-tensor pass names it.
    bad = _corrupt(buckets[1], at=70)  # inside c.weight (offset 64)
    digest = CHECKSUMS["crc32"](bad.buffer)
    import dataclasses

    resealed = dataclasses.replace(bad.header, checksum=digest).with_buffer(bad.buffer)
    assert validate_sync([buckets[0], resealed]) == 2
    with pytest.raises(WeightSyncError, match=r"checksum mismatches: \['c\.weight'\]"):
        validate_sync([buckets[0], resealed], check_every_tensor=True)
