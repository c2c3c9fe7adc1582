"""Collective broadcast transport: rank 0 (the sender) streams a sync to every other rank of
a group of its own, gloo over TCP on CPUs and NCCL through CuPy on GPUs.

Protocol of one sync, all broadcast from rank 0, per bucket: a (2,) int64 tensor ``[header
bytes, buffer bytes]``, the header as JSON bytes (`BucketHeader.to_wire`), then the buffer;
after the last bucket ``[0, 0]``. Receivers therefore need nothing but the group: a streaming
sender (ZeRO-3 gathering one parameter at a time) sends each bucket as it is packed, and the
end marker fills in the number of buckets. Both backends run this same code, so the CPU tests
exercise the group setup, the ordering and the failure paths that GPUs run.

The group is separate from any ``torch.distributed`` default group the processes have (the
learner's DeepSpeed group, vLLM's own): gloo runs on a ``ProcessGroupGloo`` of its own over a
``TCPStore`` hosted by rank 0, NCCL on a CuPy communicator. Build it by making a
`BroadcastGroupSpec` (`new_broadcast_group`) and calling ``BroadcastGroup(spec, rank=r)`` in
every member at the same time: construction returns once every rank has joined. A rank that
does not arrive, or a sender that stops mid-sync, makes the others fail after
``spec.timeout_s`` (gloo; CuPy's NCCL has no timeout).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlhf.weights.format import BucketHeader, WeightBucket, WeightSyncError, as_uint8
from rlhf.weights.ports import free_port
from rlhf.weights.registry import TransportSpec, register

if TYPE_CHECKING:
    from torch.types import Device


@dataclass(frozen=True)
class BroadcastGroupSpec:
    """What every member needs to join a group.

    Attributes:
        backend: ``gloo`` (tensors on the CPU) or ``nccl`` (tensors on each rank's GPU).
        world_size: 1 sender + the receivers.
        host: gloo: the address rank 0 listens on (reachable by every member).
        port: gloo: the port of rank 0's TCP store.
        unique_id: nccl: ``cupy.cuda.nccl.get_unique_id()`` made by rank 0's process.
        timeout_s: gloo: how long a member waits for the others (joining, each broadcast).
    """

    backend: str
    world_size: int
    host: str = "127.0.0.1"
    port: int = 0
    unique_id: tuple[int, ...] = ()
    timeout_s: float = 300.0


def _nccl() -> ModuleType:
    """CuPy's ``cupy.cuda.nccl`` (untyped: CuPy ships no stubs)."""
    try:
        from cupy.cuda import nccl  # pyright: ignore[reportMissingImports]
    except ImportError as exc:
        raise ImportError(
            "the NCCL broadcast needs CuPy with NCCL: pip install cupy-cuda12x (or "
            "cupy-cuda13x, matching the machine's CUDA)"
        ) from exc
    return nccl


def new_broadcast_group(
    *, backend: str, world_size: int, host: str = "127.0.0.1", timeout_s: float = 300.0
) -> BroadcastGroupSpec:
    """A spec for a new group; call it in rank 0's process (NCCL ids and the gloo port are
    made there) and hand the spec to every member.

    Raises:
        ValueError: an unknown backend or fewer than 2 ranks.
    """
    if backend not in _COLLECTIVES:
        raise ValueError(f"unknown broadcast backend {backend!r}; choose {sorted(_COLLECTIVES)}")
    if world_size < 2:
        raise ValueError(f"a broadcast group needs a sender and a receiver, got {world_size}")
    if backend == "nccl":
        unique_id = tuple(_nccl().get_unique_id())
        return BroadcastGroupSpec(backend, world_size, unique_id=unique_id, timeout_s=timeout_s)
    return BroadcastGroupSpec(backend, world_size, host=host, port=free_port(), timeout_s=timeout_s)


class _Collective(Protocol):
    device: torch.device

    def broadcast(self, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class _Gloo:
    """A ``ProcessGroupGloo`` over rank 0's ``TCPStore``; CPU tensors."""

    def __init__(self, spec: BroadcastGroupSpec, rank: int, device: Device) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=spec.timeout_s)
        self.device = torch.device("cpu")
        # TCPStore and PrefixStore are public torch.distributed API (documented there), but torch
        # re-exports them from its C extension without `__all__`, so pyright calls them private.
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            spec.host,
            spec.port,
            spec.world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        self._store = store  # rank 0 hosts it: keep it for the group's life
        prefixed = dist.PrefixStore("rlhf-weights", store)  # pyright: ignore[reportPrivateImportUsage]
        # Any: torch's stub of ProcessGroupGloo lacks the collectives (``broadcast``) that
        # its C++ class has.
        self._group: Any = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([tensor], options).wait()

    def close(self) -> None:
        self._group = None
        self._store = None


class _NcclComm(Protocol):
    """What this module calls on a ``cupy.cuda.nccl.NcclCommunicator``."""

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None: ...

    def destroy(self) -> None: ...


class _Nccl:
    """A CuPy NCCL communicator on this rank's GPU (kept apart from the process groups that
    vLLM and the learner build with torch.distributed)."""

    def __init__(self, spec: BroadcastGroupSpec, rank: int, device: Device) -> None:
        nccl = _nccl()
        import cupy  # pyright: ignore[reportMissingImports]

        index = torch.cuda.current_device() if device is None else torch.device(device).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        with cupy.cuda.Device(self.device.index):
            self._comm: _NcclComm | None = nccl.NcclCommunicator(
                spec.world_size, tuple(spec.unique_id), rank
            )
        self._uint8 = nccl.NCCL_UINT8

    def broadcast(self, tensor: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(self.device)
        raw = tensor.view(torch.uint8)
        assert self._comm is not None, "broadcast on a closed NCCL communicator"
        self._comm.bcast(raw.data_ptr(), raw.numel(), self._uint8, 0, stream.cuda_stream)
        stream.synchronize()

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()


_COLLECTIVES: dict[str, Callable[[BroadcastGroupSpec, int, Device], _Collective]] = {
    "gloo": _Gloo,
    "nccl": _Nccl,
}


class BroadcastGroup:
    """One member of a broadcast group: rank 0 sends, the others receive.

    Args:
        spec: From `new_broadcast_group`.
        rank: This member's rank; 0 is the sender.
        device: NCCL: this rank's CUDA device (default the current one); gloo ignores it.

    Raises:
        WeightSyncError: when the group cannot be formed (a member missing after
            ``spec.timeout_s``), naming the spec.
    """

    def __init__(self, spec: BroadcastGroupSpec, *, rank: int, device: Device = None) -> None:
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} is outside a group of {spec.world_size}")
        if spec.backend not in _COLLECTIVES:
            raise ValueError(
                f"unknown broadcast backend {spec.backend!r}; choose {sorted(_COLLECTIVES)}"
            )
        self.spec, self.rank = spec, rank
        try:
            self._collective: _Collective | None = _COLLECTIVES[spec.backend](spec, rank, device)
        except RuntimeError as exc:
            raise WeightSyncError(
                f"rank {rank} could not join the {spec.backend} broadcast group of "
                f"{spec.world_size} ({exc}); every member must join within {spec.timeout_s} s"
            ) from exc

    def _live(self) -> _Collective:
        if self._collective is None:
            raise WeightSyncError("this broadcast group was closed")
        return self._collective

    def send(self, buckets: Iterable[WeightBucket]) -> int:
        """Rank 0: stream ``buckets`` to every receiver, then the end marker; returns the
        number of buckets sent."""
        if self.rank != 0:
            raise WeightSyncError(f"rank {self.rank} receives; only rank 0 sends")
        collective = self._live()
        count = 0
        for b in buckets:
            header = json.dumps(b.header.to_wire()).encode()
            buffer = as_uint8(b.buffer).to(collective.device)
            sizes = torch.tensor([len(header), buffer.numel()], dtype=torch.int64)
            collective.broadcast(sizes.to(collective.device))
            collective.broadcast(
                torch.frombuffer(bytearray(header), dtype=torch.uint8).to(collective.device)
            )
            collective.broadcast(buffer.contiguous())
            count += 1
        collective.broadcast(torch.zeros(2, dtype=torch.int64, device=collective.device))
        return count

    def receive(self) -> list[WeightBucket]:
        """Ranks > 0: the buckets of the next sync, buffers on this rank's device.

        Raises:
            WeightSyncError: the sender stopped mid-sync (gloo: after ``spec.timeout_s``), or
                a header that announced another number of buckets than arrived.
        """
        if self.rank == 0:
            raise WeightSyncError("rank 0 is the sender of the group; it does not receive")
        collective = self._live()
        device = collective.device
        buckets: list[WeightBucket] = []
        try:
            while True:
                sizes = torch.zeros(2, dtype=torch.int64, device=device)
                collective.broadcast(sizes)
                header_bytes, nbytes = (int(x) for x in sizes.tolist())
                if header_bytes == 0:
                    break
                raw = torch.zeros(header_bytes, dtype=torch.uint8, device=device)
                collective.broadcast(raw)
                header = BucketHeader.from_wire(json.loads(bytes(raw.cpu().tolist())))
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
                collective.broadcast(buffer)
                buckets.append(header.with_buffer(buffer))
        except RuntimeError as exc:
            raise WeightSyncError(
                f"the weight broadcast stopped after {len(buckets)} bucket(s): {exc}"
            ) from exc
        announced = {b.total for b in buckets if b.total is not None}
        if announced and announced != {len(buckets)}:
            raise WeightSyncError(
                f"the sender announced {sorted(announced)} buckets but sent {len(buckets)}"
            )
        return [b.with_total(len(buckets)) for b in buckets]

    def close(self) -> None:
        """Leave the group (every member should)."""
        collective, self._collective = self._collective, None
        if collective is not None:
            collective.close()


def _new_group(*, world_size: int, device: torch.device | str, host: str) -> BroadcastGroupSpec:
    """Rank 0's new group: gloo over ``host`` for CPU tensors, else NCCL."""
    gloo = torch.device(device).type != "cuda"
    return new_broadcast_group(
        backend="gloo" if gloo else "nccl",
        world_size=world_size,
        host=host if gloo else "127.0.0.1",
    )


def _join(spec: BroadcastGroupSpec, *, rank: int, device: Device = None) -> BroadcastGroup:
    return BroadcastGroup(spec, rank=rank, device=device)


SPEC = register(
    TransportSpec(
        name="broadcast",
        reach="cluster",
        devices=frozenset({"cpu", "cuda"}),
        on_device=True,
        auto={"cuda": 3},  # on CPUs shared memory (one machine) or the object store is faster
        new_group=_new_group,
        join=_join,
        requires={"cuda": ("cupy", "CuPy with NCCL (pip install cupy-cuda12x, or cupy-cuda13x)")},
    )
)
