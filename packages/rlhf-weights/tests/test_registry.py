"""The transports' registry: each transport's facts decide where it serves (`choose`), a
transport registered from outside is chosen and received like the built-in ones, and a spec
that is neither shape is refused."""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator

import pytest
import torch

from rlhf.weights import (
    TRANSPORTS,
    Placement,
    TransportSpec,
    WeightBucket,
    choose,
    iter_buckets,
    iter_tensors,
    receivers,
    register,
    transport,
    validate_sync,
)


def where(**kw) -> Placement:
    return Placement(**{"gpu": False, "colocated": False, "num_engines": 1, "nodes": 1, **kw})


def auto(cupy: bool = False, **kw) -> str:
    return choose("auto", where(**kw), installed=lambda module: cupy or module != "cupy")[0].name


def test_auto_follows_the_placement() -> None:
    assert auto() == "shared_memory"  # one CPU machine
    assert auto(nodes=3) == "object_store"  # CPU nodes: shared memory cannot reach
    assert auto(gpu=True, colocated=True) == "cuda_ipc"  # the engine on the actor's GPU
    # Two colocated engines: engine 1 sits on actor rank 1's GPU, which rank 0 cannot share.
    assert auto(gpu=True, colocated=True, num_engines=2, cupy=True) == "broadcast"
    assert auto(gpu=True, cupy=True) == "broadcast"  # engines on other GPUs
    assert auto(gpu=True, cupy=True, nodes=2, colocated=True) == "broadcast"  # NCCL spans nodes
    assert auto(gpu=True) == "object_store"  # ... without CuPy


def test_the_reason_names_what_was_passed_over() -> None:
    _, why = choose("auto", where(gpu=True, num_engines=2), installed=lambda m: False)
    assert why == (
        "auto: 1 node with GPUs, 2 engines; not cuda_ipc: needs the engine on the actor's GPU: "
        "GPUs, --train.colocate_all True and --vllm.num_engines 1; not broadcast: on GPUs "
        "needs CuPy with NCCL (pip install cupy-cuda12x, or cupy-cuda13x)"
    )


def test_requests_are_held_to_the_facts() -> None:
    yes = lambda module: True  # noqa: E731
    assert choose("broadcast", where(), installed=yes)[0].name == "broadcast"  # gloo on CPUs
    with pytest.raises(ValueError, match="^cuda_ipc needs the engine on the actor's GPU"):
        choose("cuda_ipc", where(gpu=True), installed=yes)
    with pytest.raises(ValueError, match="^shared_memory needs one machine; the cluster has 2"):
        choose("shared_memory", where(nodes=2), installed=yes)
    with pytest.raises(ValueError, match="^broadcast on GPUs needs CuPy"):
        choose("broadcast", where(gpu=True), installed=lambda m: False)
    with pytest.raises(KeyError, match="unknown weight transport 'nccl'; known: "):
        transport("nccl")


def test_facts_are_declared_once_per_transport() -> None:
    assert transport("cuda_ipc").bucket_mib == 512 and transport("object_store").bucket_mib == 64
    assert {n for n, s in TRANSPORTS.items() if s.rejoinable} == {"object_store", "shared_memory"}
    assert {n for n, s in TRANSPORTS.items() if s.grouped} == {"broadcast", "broadcast_delta"}
    assert {n for n, s in TRANSPORTS.items() if s.release_after_load} == {"cuda_ipc"}
    assert {type(r).__name__ for _, r in receivers().values()} == {
        "ObjectStoreReceiver", "SharedMemoryReceiver", "CudaIpcReceiver", "DeltaReceiver",
    }  # fmt: skip
    # The delta transports are never chosen by auto (opt-in until measured on GPUs).
    assert not transport("shared_memory_delta").auto and not transport("broadcast_delta").auto


# -- a transport from outside the package -----------------------------------------------------


class PickleSync(bytes):
    """The sync: the buckets pickled (headers and buffers)."""


class PickleSender:
    def send(self, buckets: Iterable[WeightBucket]) -> PickleSync:
        out = [(b.header, b.buffer.clone()) for b in buckets]
        return PickleSync(pickle.dumps([(h.with_total(len(out)), buf) for h, buf in out]))

    def close(self) -> None:
        pass


class PickleReceiver:
    def receive(self, sync: PickleSync) -> list[WeightBucket]:
        return [h.with_buffer(buf) for h, buf in pickle.loads(sync)]

    def close(self) -> None:
        pass


@pytest.fixture
def pickled() -> Iterator[TransportSpec]:
    spec = register(
        TransportSpec(
            name="pickled",
            reach="node",
            devices=frozenset({"cpu"}),
            auto={"cpu": 9},
            sender=PickleSender,
            receiver=PickleReceiver,
            sync_type=PickleSync,
        )
    )
    yield spec
    del TRANSPORTS["pickled"]


def test_a_registered_transport_is_chosen_and_received(pickled) -> None:
    assert auto() == "pickled"  # the highest preference on one CPU machine
    assert auto(nodes=2) == "object_store"  # its reach is one machine
    sent = {"w": torch.arange(6.0), "b": torch.ones(3, dtype=torch.bfloat16)}
    sync = pickled.sender().send(iter_buckets(sent.items(), version=4, bucket_bytes=16))
    name, receiver = receivers()[type(sync)]
    buckets = receiver.receive(sync)
    validate_sync(buckets)
    assert name == "pickled" and [b.version for b in buckets] == [4, 4]
    got = dict(iter_tensors(buckets))
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in sent.items())


def test_a_name_twice_and_a_spec_of_neither_shape_are_refused(pickled) -> None:
    with pytest.raises(ValueError, match="'pickled' is already registered"):
        register(pickled)
    with pytest.raises(ValueError, match="give sender, receiver and sync_type, or new_group"):
        TransportSpec(name="half", reach="node", devices=frozenset({"cpu"}), sender=PickleSender)
