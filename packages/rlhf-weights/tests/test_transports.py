"""Every transport end to end between real processes (Ray actors, spawned processes): what
the receivers get validates and equals what was sent, byte for byte; and the failure paths
end in a `WeightSyncError` that says what happened."""

from __future__ import annotations

import json
import time
from multiprocessing import shared_memory

import pytest
import ray
import torch

from rlhf.weights import (
    BroadcastGroup,
    CudaIpcReceiver,
    CudaIpcSender,
    CudaIpcSync,
    ObjectStoreReceiver,
    ObjectStoreSender,
    SharedMemoryReceiver,
    SharedMemorySender,
    WeightSyncError,
    iter_buckets,
    iter_tensors,
    new_broadcast_group,
    pack_buckets,
    validate_sync,
)


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=gen),
        "norm.weight": torch.randn(16, generator=gen).to(torch.bfloat16),
        "head.bias": torch.randn(64, generator=gen).to(torch.float16),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def received(buckets) -> dict[str, torch.Tensor]:
    """What a receiver sees once the sync validated (copies: the views may go away)."""
    validate_sync(buckets)
    return {k: v.clone() for k, v in iter_tensors(buckets)}


def assert_same(got: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(sent)
    for k, v in sent.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote
class Receiver:
    """A process that receives with one of the receivers and reports what it got."""

    def __init__(self, kind: str) -> None:
        self.receiver = {"object_store": ObjectStoreReceiver, "shm": SharedMemoryReceiver}[kind]()

    def receive(self, sync) -> dict[str, torch.Tensor]:
        return received(self.receiver.receive(sync))


def test_object_store_streams_buckets_into_another_process(cluster) -> None:
    sent = weights(1)
    sender = ObjectStoreSender()
    sync = sender.send(iter_buckets(sent.items(), version=1, bucket_bytes=4096))
    assert len(sync.headers) == len(sync.refs) == 2
    assert {h.total for h in sync.headers} == {2}  # filled in once the stream ended
    actor = Receiver.remote("object_store")
    assert_same(ray.get(actor.receive.remote(sync)), sent)


def test_shared_memory_reuses_its_segment_and_grows_in_another_process(cluster) -> None:
    actor = Receiver.remote("shm")
    small = {"a": torch.arange(6, dtype=torch.float32)}
    big = {"a": torch.arange(6, dtype=torch.float32) * 2, "b": torch.ones(4096)}
    with SharedMemorySender() as sender:
        first = sender.send(pack_buckets(small.items(), version=1, bucket_bytes=1 << 20))
        assert_same(ray.get(actor.receive.remote(first)), small)
        again = sender.send(pack_buckets({"a": small["a"] + 1}.items(), version=2, bucket_bytes=64))
        assert again.name == first.name  # rewritten in place
        assert_same(ray.get(actor.receive.remote(again)), {"a": small["a"] + 1})
        grown = sender.send(pack_buckets(big.items(), version=3, bucket_bytes=1 << 20))
        assert grown.name != first.name
        assert_same(ray.get(actor.receive.remote(grown)), big)
        with pytest.raises(FileNotFoundError):  # the outgrown segment was unlinked
            shared_memory.SharedMemory(name=first.name)
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=grown.name)


def test_shared_memory_receiver_in_the_senders_process_and_a_short_segment() -> None:
    sent = weights(2)
    receiver = SharedMemoryReceiver()
    with SharedMemorySender() as sender:
        sync = sender.send(iter_buckets(sent.items(), version=2, bucket_bytes=1024))
        assert_same(received(receiver.receive(sync)), sent)
        import dataclasses

        header = sync.headers[-1]
        longer = dataclasses.replace(header, nbytes=header.nbytes + (1 << 20))
        bad = dataclasses.replace(sync, headers=(*sync.headers[:-1], longer))
        with pytest.raises(WeightSyncError, match="smaller than its sync"):
            receiver.receive(bad)
    receiver.close()


def test_cuda_ipc_argument_checks_without_a_gpu() -> None:
    (bucket,) = pack_buckets([("w", torch.ones(4))], version=1, bucket_bytes=1 << 10)
    with pytest.raises(ValueError, match="CUDA IPC shares 1-D uint8 CUDA buffers"):
        CudaIpcSender().send([bucket])
    with pytest.raises(ValueError, match="needs at least one bucket"):
        CudaIpcSender().send([])
    receiver = CudaIpcReceiver()
    unseen = CudaIpcSync((bucket.header,), ((None, ()),), "GPU-00000000-0000-0000-0000-0000")
    with pytest.raises(WeightSyncError, match="CUDA IPC needs the sender and the engine on"):
        receiver.receive(unseen)
    with pytest.raises(WeightSyncError, match="1 headers but 0 handles"):
        receiver.receive(CudaIpcSync((bucket.header,), (), "x"))


# -- broadcast (gloo) -------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class Member:
    """A receiving rank of a broadcast group in a process of its own."""

    def ready(self) -> bool:
        return True

    def run(self, spec, rank: int, syncs: int) -> list:
        """Join, receive ``syncs`` syncs in order; per sync (version, buckets, tensors), or
        the error's type and message."""
        out: list = []
        try:
            group = BroadcastGroup(spec, rank=rank)
            for _ in range(syncs):
                buckets = group.receive()
                out.append((buckets[0].version, len(buckets), received(buckets)))
            group.close()
        except Exception as exc:  # reported to the test, which asserts on it
            out.append(("error", type(exc).__name__, str(exc)))
        return out


def _spawn(spec, ranks, syncs: int) -> list:
    """Receivers joining ``spec``, once their processes are up: on a loaded machine an actor's
    start alone can outlast a short group timeout."""
    members = [Member.remote() for _ in ranks]
    ray.get([m.ready.remote() for m in members])
    return [m.run.remote(spec, r, syncs) for m, r in zip(members, ranks, strict=True)]


def test_gloo_broadcast_streams_syncs_in_order_to_every_rank(cluster) -> None:
    spec = new_broadcast_group(backend="gloo", world_size=3, timeout_s=60)
    refs = _spawn(spec, [1, 2], syncs=2)
    group = BroadcastGroup(spec, rank=0)  # returns once both receivers joined
    first, second = weights(3), weights(4)
    # 100-byte buckets: embed (4096 B), norm (32 B; head would end at 64 + 128), head (128 B)
    # and step (8 B; it would end at 128 + 8) each get one.
    assert group.send(iter_buckets(first.items(), version=7, bucket_bytes=100)) == 4
    assert group.send(iter_buckets(second.items(), version=8, bucket_bytes=1 << 20)) == 1
    group.close()
    for items in ray.get(refs):
        assert [(v, n) for v, n, _ in items] == [(7, 4), (8, 1)]
        assert_same(items[0][2], first)
        assert_same(items[1][2], second)
    with pytest.raises(WeightSyncError, match="closed"):
        group.send([])


def test_gloo_broadcast_failure_paths_are_named(cluster) -> None:
    spec = new_broadcast_group(backend="gloo", world_size=2, timeout_s=3)
    with pytest.raises(ValueError, match="outside a group of 2"):
        BroadcastGroup(spec, rank=2)
    with pytest.raises(ValueError, match="unknown broadcast backend 'mpi'"):
        new_broadcast_group(backend="mpi", world_size=2)
    with pytest.raises(ValueError, match="needs a sender and a receiver"):
        new_broadcast_group(backend="gloo", world_size=1)
    # A member that never arrives: the sender's join fails after the timeout, naming it.
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="could not join the gloo broadcast group of 2"):
        BroadcastGroup(spec, rank=0)
    assert time.monotonic() - start < 60
    # A sender that joins but stops before the end marker: the receiver fails, not hangs.
    spec = new_broadcast_group(backend="gloo", world_size=2, timeout_s=3)
    (ref,) = _spawn(spec, [1], syncs=1)
    group = BroadcastGroup(spec, rank=0)
    with pytest.raises(WeightSyncError, match="only rank 0 sends|does not receive"):
        group.receive()
    buckets = iter_buckets(weights(5).items(), version=1, bucket_bytes=1024)
    collective = group._live()  # send one bucket's frames, then go quiet
    first = next(buckets)
    header = json.dumps(first.header.to_wire()).encode()
    collective.broadcast(torch.tensor([len(header), first.nbytes], dtype=torch.int64))
    collective.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    collective.broadcast(first.buffer)
    ((status, kind, message),) = ray.get(ref)
    assert (status, kind) == ("error", "WeightSyncError")
    assert "the weight broadcast stopped after 1 bucket(s)" in message
    group.close()


# -- every registered transport ---------------------------------------------------------------


@ray.remote(num_cpus=0)
class Engine:
    """An engine's end of every registered transport, as `rlhf.rollout` builds it."""

    def __init__(self) -> None:
        from rlhf.weights import receivers

        self.receivers = receivers()
        self.member = None

    def ready(self) -> bool:
        return True

    def receive(self, sync) -> tuple[str, dict[str, torch.Tensor]]:
        name, receiver = self.receivers[type(sync)]
        return name, received(receiver.receive(sync))

    def join(self, kind: str, group) -> None:
        from rlhf.weights import transport

        self.member = transport(kind).join(group, rank=1)

    def receive_group(self) -> dict[str, torch.Tensor]:
        return received(self.member.receive())


def test_every_registered_transport_on_cpus_delivers_the_same_bytes(cluster) -> None:
    """Each transport that serves CPUs, built from its registry entry alone (sender, receiver
    by the sync's type, or a group's two ends) carries two syncs (the second changes one
    element: a delta transport sends it as a delta) whose checksums validate and whose
    tensors equal what was sent, in another process."""
    from rlhf.weights import TRANSPORTS, Placement

    cpu = Placement(gpu=False, colocated=False, num_engines=1, nodes=1)
    served = [s for s in TRANSPORTS.values() if s.unusable(cpu, installed=lambda m: True) is None]
    assert {s.name for s in served} >= {"object_store", "shared_memory", "broadcast"}
    for i, spec in enumerate(served):
        first = weights(10 + i)
        second = {**first, "embed.weight": first["embed.weight"].clone()}
        second["embed.weight"][3, 4] += 1.0
        engine = Engine.remote()
        ray.get(engine.ready.remote())
        if spec.grouped:
            assert spec.new_group is not None and spec.join is not None
            group = spec.new_group(world_size=2, device="cpu", host="127.0.0.1")
            joined = engine.join.remote(spec.name, group)
            sender = spec.join(group, rank=0)
            ray.get(joined)
        else:
            assert spec.sender is not None
            sender = spec.sender()
        for version, sent in enumerate((first, second), 1):
            buckets = iter_buckets(sent.items(), version=version, bucket_bytes=1024)
            if spec.grouped:
                got = engine.receive_group.remote()
                sender.send(buckets)
                assert_same(ray.get(got), sent)
            else:
                sync = sender.send(buckets)
                assert type(sync) is spec.sync_type
                name, got = ray.get(engine.receive.remote(sync))
                assert name == spec.name, spec.name
                assert_same(got, sent)
        sender.close()
        ray.kill(engine)
