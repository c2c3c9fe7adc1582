"""The bucket headers' plain-data form (what a sender outside rlhf.rollout builds) and the
transports' argument checks that run without a GPU."""

import hashlib
import json

import pytest
import torch

from rlhf.rollout import WeightSyncError, header_from_wire, pack_buckets, validate_sync
from rlhf.rollout.transports.cuda_ipc import CudaIpcSync, receive_cuda_ipc


def test_pack_buckets_layout_by_hand() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])  # 12 bytes at offset 0
    b = torch.tensor([7, 8], dtype=torch.int64)  # 16 bytes at the next 64-byte boundary
    c = torch.ones(5, dtype=torch.bfloat16)  # 10 bytes: 64 + 16 + pad to 128 + 10 > 120
    (b0, b1) = pack_buckets(
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


def test_headers_survive_json_and_rebuild_a_valid_sync(pack) -> None:
    state = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(4)}
    buckets = pack(state, version=3, bucket_bytes=24)
    assert len(buckets) == 2
    wire = json.loads(json.dumps([b.header().to_wire() for b in buckets]))
    headers = [header_from_wire(w) for w in wire]
    assert headers == [b.header() for b in buckets]
    rebuilt = [h.with_buffer(b.buffer) for h, b in zip(headers, buckets, strict=True)]
    assert (
        validate_sync(
            rebuilt, expected={"a.weight": ((2, 3), "float32"), "b.bias": ((4,), "float32")}
        )
        == 3
    )
    assert header_from_wire(headers[0]) is headers[0]


def test_malformed_wire_headers_name_the_problem(pack) -> None:
    wire = pack({"a.weight": torch.ones(2)}, version=1, bucket_bytes=64)[0].header().to_wire()
    with pytest.raises(WeightSyncError, match=r"bucket header lacks \['nbytes'\]"):
        header_from_wire({k: v for k, v in wire.items() if k != "nbytes"})
    with pytest.raises(WeightSyncError, match=r"malformed bucket header \(index 0\)"):
        header_from_wire({**wire, "tensors": [["a.weight", "float32", [2]]]})
    with pytest.raises(WeightSyncError, match=r"malformed bucket header"):
        header_from_wire({**wire, "version": "seven"})


def test_cuda_ipc_refuses_a_gpu_it_cannot_see(pack) -> None:
    header = pack({"a.weight": torch.ones(2)}, version=1, bucket_bytes=64)[0].header()
    sync = CudaIpcSync((header,), ((None, ()),), "GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(
        WeightSyncError, match="CUDA IPC needs the sender and the engine on the same GPU"
    ):
        receive_cuda_ipc(sync)
    with pytest.raises(WeightSyncError, match="1 headers but 0 handles"):
        receive_cuda_ipc({"headers": [header.to_wire()], "handles": [], "device_uuid": "x"})
    with pytest.raises(WeightSyncError, match="lacks 'device_uuid'"):
        receive_cuda_ipc({"headers": [], "handles": []})


def test_crc32_default_on_host_and_its_digest() -> None:
    import zlib

    data = torch.arange(10, dtype=torch.float32)
    (bucket,) = pack_buckets([("w", data)], version=1, bucket_bytes=1024)
    assert bucket.checksum_algorithm == "crc32"
    raw = data.numpy().tobytes()
    assert bucket.tensors[0].checksum == f"{len(raw):x}-{zlib.crc32(raw):08x}"


def test_shared_memory_channel_reuses_its_segment_and_grows_when_needed(pack) -> None:
    from multiprocessing import shared_memory

    from rlhf.rollout.buckets import iter_tensors
    from rlhf.rollout.transports.host import SharedMemoryChannel, SharedMemoryReceiver

    small = {"a": torch.arange(6, dtype=torch.float32)}
    big = {"a": torch.arange(6, dtype=torch.float32) * 2, "b": torch.ones(4096)}
    receiver = SharedMemoryReceiver()
    with SharedMemoryChannel() as channel:
        first = channel.send(pack(small, version=1, bucket_bytes=1 << 20))
        assert first.persistent
        got = dict(iter_tensors(receiver.buckets(first)))
        assert torch.equal(got["a"], small["a"])
        again = channel.send(pack({"a": small["a"] + 1}, version=2, bucket_bytes=1 << 20))
        assert again.name == first.name  # rewritten in place
        assert torch.equal(dict(iter_tensors(receiver.buckets(again)))["a"], small["a"] + 1)
        grown = channel.send(pack(big, version=3, bucket_bytes=1 << 20))
        assert grown.name != first.name
        got = dict(iter_tensors(receiver.buckets(grown)))
        assert torch.equal(got["a"], big["a"]) and torch.equal(got["b"], big["b"])
        with pytest.raises(FileNotFoundError):  # the outgrown segment was unlinked
            shared_memory.SharedMemory(name=first.name)
        del got
    receiver.close()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=grown.name)
