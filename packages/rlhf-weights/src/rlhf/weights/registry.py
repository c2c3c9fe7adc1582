"""The transports' registry: each transport declares its facts once, beside its code, as a
`TransportSpec` (`register`); the learner builds its sender, the engines their receivers and a
launcher its choice (`choose`) from these facts alone, so a new transport is a new module of
`rlhf.weights.transports` and nothing else.

Two shapes of transport:

- *sync objects*: rank 0's `Sender` turns the buckets into a small picklable sync (refs, a
  segment name, IPC handles) that is handed to every engine, whose `Receiver` (picked by the
  sync's type) reads the buckets back;
- *groups*: the sender and the engines form a group (`TransportSpec.new_group`, then
  `TransportSpec.join` in every member); the engines receive while rank 0 sends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from rlhf.weights.format import WeightBucket


class Sender(Protocol):
    """Rank 0's end: ``send`` streams buckets out and returns the sync to hand to the engines
    (a group member returns the number of buckets sent); ``close`` releases what the last
    sync kept alive (a segment, IPC buffers, the group membership)."""

    def send(self, buckets: Iterable[WeightBucket]) -> object: ...

    def close(self) -> None: ...


class Receiver(Protocol):
    """An engine's end of a sync-object transport: the buckets of ``sync``, to be checked with
    `rlhf.weights.validate_sync` before anything is loaded.

    ``sync`` is the type its transport's sender makes (`TransportSpec.sync_type`); the registry
    pairs a receiver with that type at run time (`receivers`), which no static type says, so
    the parameter stays ``Any`` (an implementation names its own sync type)."""

    def receive(self, sync: Any) -> list[WeightBucket]: ...

    def close(self) -> None: ...


@runtime_checkable
class Measured(Protocol):
    """A sender that reports what its last sync sent (e.g. a delta sender: bytes against a
    full sync's, the fraction of words that changed)."""

    def metrics(self) -> dict[str, float]: ...


class GroupMember(Sender, Protocol):
    """A group transport's member: rank 0 sends (returning the number of buckets sent), the
    others ``receive`` the next sync."""

    def send(self, buckets: Iterable[WeightBucket]) -> int: ...

    def receive(self) -> list[WeightBucket]: ...


Reach = Literal["gpu", "node", "cluster"]
"""Which engines a sender reaches: those on its own GPU, on its machine, on any node."""


@dataclass(frozen=True)
class Placement:
    """Where the engines sit relative to the actor's rank 0, as a transport needs to know.

    Attributes:
        gpu: The cluster has GPUs (the actor trains on CUDA).
        colocated: The engines share the learners' GPUs.
        num_engines: Engines to reach.
        nodes: Alive nodes of the cluster.
    """

    gpu: bool
    colocated: bool
    num_engines: int
    nodes: int

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"

    def describe(self) -> str:
        nodes = f"{self.nodes} node{'s' * (self.nodes > 1)}"
        engines = f"{self.num_engines} engine{'s' * (self.num_engines > 1)}"
        where = " on the learners' GPUs" if self.gpu and self.colocated else ""
        return f"{nodes} with {'GPUs' if self.gpu else 'CPUs only'}, {engines}{where}"

    def reached(self, reach: Reach) -> str | None:
        """Why a sender of ``reach`` misses an engine here; None when it reaches them all."""
        if reach == "gpu" and not (self.gpu and self.colocated and self.num_engines == 1):
            return (
                "needs the engine on the actor's GPU: GPUs, --train.colocate_all True and "
                "--vllm.num_engines 1"
            )
        if reach in ("gpu", "node") and self.nodes > 1:
            return f"needs one machine; the cluster has {self.nodes} nodes"
        return None


@dataclass(frozen=True, kw_only=True)
class TransportSpec:
    """One transport's facts and factories.

    Attributes:
        name: Its name (``--train.weight_transport``).
        reach: Which engines its sender reaches (`Reach`).
        devices: Where it runs: ``cpu`` (no GPUs), ``cuda``.
        on_device: Buckets are packed on the sending rank's device (else in host memory).
        bucket_mib: Its bucket size when none is asked for.
        rejoinable: The last sync stays readable until the next one, so an engine started in
            place of a dead one loads the very sync the others loaded.
        release_after_load: The sender releases what a sync keeps alive once every engine
            loaded it (CUDA IPC buffers), instead of at its next send.
        auto: Preference under ``auto`` per device (higher first; absent: never chosen).
        sender: Makes rank 0's sender (sync-object transports).
        receiver: Makes an engine's receiver (sync-object transports).
        sync_type: The type of the sync its sender makes (how an engine picks the receiver).
        new_group: Group transports, in rank 0's process: ``(world_size, device, host) ->
            spec`` of a new group (``host``: an address every member reaches).
        join: Group transports, in every member: ``(spec, rank, device) -> GroupMember``.
        requires: Per device, the module it needs there and what that is, with how to
            install it.
    """

    name: str
    reach: Reach
    devices: frozenset[str]
    on_device: bool = False
    bucket_mib: int = 64
    rejoinable: bool = False
    release_after_load: bool = False
    auto: Mapping[str, int] = field(default_factory=dict)
    sender: Callable[[], Sender] | None = None
    receiver: Callable[[], Receiver] | None = None
    sync_type: type | None = None
    new_group: Callable[..., object] | None = None
    join: Callable[..., GroupMember] | None = None
    requires: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        objects = (self.sender, self.receiver, self.sync_type)
        if (self.new_group is None) == (self.join is None) == (None in objects):
            raise ValueError(
                f"transport {self.name!r}: give sender, receiver and sync_type, or new_group "
                "and join"
            )

    @property
    def grouped(self) -> bool:
        """A group transport (the engines receive while rank 0 sends)."""
        return self.join is not None

    def unusable(self, placement: Placement, *, installed: Callable[[str], bool]) -> str | None:
        """Why this transport cannot serve ``placement`` (``installed``: whether a module
        can be imported where it would run); None when it can."""
        missing = placement.reached(self.reach)
        if missing:
            return missing
        words = _DEVICE_WORDS[placement.device]
        if placement.device not in self.devices:
            return f"does not run on {words}"
        module, what = self.requires.get(placement.device, (None, ""))
        if module is not None and not installed(module):
            return f"on {words} needs {what}"
        return None


_DEVICE_WORDS = {"cpu": "CPUs", "cuda": "GPUs"}

TRANSPORTS: dict[str, TransportSpec] = {}
"""Every registered transport by name, in registration order."""


def register(spec: TransportSpec) -> TransportSpec:
    """Add ``spec`` to `TRANSPORTS` (a name registered twice is an error)."""
    if spec.name in TRANSPORTS or spec.name == "auto":
        raise ValueError(f"transport {spec.name!r} is already registered")
    TRANSPORTS[spec.name] = spec
    return spec


def transport(name: str) -> TransportSpec:
    """The registered transport ``name``.

    Raises:
        KeyError: an unknown name, listing the known ones.
    """
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise KeyError(
            f"unknown weight transport {name!r}; known: {', '.join(TRANSPORTS)}"
        ) from None


def receivers() -> dict[type, tuple[str, Receiver]]:
    """A fresh receiver for every sync-object transport, by the type of sync it reads (with
    the transport's name)."""
    return {
        s.sync_type: (s.name, s.receiver())
        for s in TRANSPORTS.values()
        if s.sync_type is not None and s.receiver is not None
    }


def choose(
    requested: str, placement: Placement, *, installed: Callable[[str], bool]
) -> tuple[TransportSpec, str]:
    """The transport for ``placement`` and why: ``requested`` when it can serve it, or under
    ``auto`` the usable one of highest preference for the placement's device.

    Raises:
        ValueError: an unknown transport, or one that cannot serve the placement (the
            message says why; the caller names its flag).
    """
    if requested != "auto":
        spec = transport(requested)
        why = spec.unusable(placement, installed=installed)
        if why is not None:
            raise ValueError(f"{requested} {why}")
        return spec, "requested"
    ranked = sorted(
        (s for s in TRANSPORTS.values() if placement.device in s.auto),
        key=lambda s: -s.auto[placement.device],
    )
    passed_over = []
    for spec in ranked:
        why = spec.unusable(placement, installed=installed)
        if why is None:
            over = f"; {'; '.join(passed_over)}" if passed_over else ""
            return spec, f"auto: {placement.describe()}{over}"
        passed_over.append(f"not {spec.name}: {why}")
    raise ValueError(f"no transport serves this placement: {'; '.join(passed_over)}")
