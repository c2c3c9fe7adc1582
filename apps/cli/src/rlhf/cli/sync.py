"""The weight sync of ``rlhf train``: the actor's weights into every engine, over the
`rlhf.weights` transport the placement calls for (``--train.weight_transport``).

Every sync streams: the actor's ranks gather one parameter at a time
(`rlhf.learner.send_weights`) and rank 0 packs buckets of ``--train.weight_bucket_mib`` as
they fill into the transport's sender; no rank holds a full state dict. Each engine receives
the sync in its actor, validates it whole (bucket and tensor checksums), loads it and reads
back what ``--vllm.verify_sync`` asks for.

The transports and their facts are `rlhf.weights`' registry; ``auto`` takes the one that
serves the placement best (`choose_transport`, `rlhf.weights.choose`): CUDA IPC when the one
engine shares the actor's GPU (``--train.colocate_all``), an NCCL broadcast when engines sit
on other GPUs (CuPy needed; without it, the object store), shared memory on one CPU machine,
and Ray's object store when the cluster spans several CPU nodes. The actor's rank 0 keeps its
sender (`rlhf.learner.RankSenders`); this module drives the syncs and handles engines that
die during one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlhf.cli.config import ConfigError
from rlhf.cli.sections import WEIGHT_TRANSPORTS
from rlhf.learner import LearnerGroup
from rlhf.rollout import RayEngine
from rlhf.weights import Placement, choose, transport


def bucket_mib(requested: int, kind: str) -> int:
    """``--train.weight_bucket_mib`` for transport ``kind``: as requested, or the
    transport's own (`rlhf.weights.TransportSpec.bucket_mib`) when 0."""
    return requested or transport(kind).bucket_mib


def choose_transport(
    requested: str,
    *,
    gpu: bool,
    colocated: bool,
    num_engines: int,
    nodes: int,
    nccl: bool,
) -> tuple[str, str]:
    """The transport to use and why (for the plan).

    Args:
        requested: ``--train.weight_transport``.
        gpu: The cluster has GPUs.
        colocated: The engines share the learners' GPUs (``--train.colocate_all``).
        num_engines: ``--vllm.num_engines``.
        nodes: Alive nodes of the Ray cluster.
        nccl: CuPy's NCCL bindings are importable on the cluster.

    Raises:
        ConfigError: a requested transport that cannot reach the engines, naming the flag.
    """
    if requested not in WEIGHT_TRANSPORTS:
        raise ConfigError(f"--train.weight_transport must be one of {WEIGHT_TRANSPORTS}")
    where = Placement(gpu=gpu, colocated=colocated, num_engines=num_engines, nodes=nodes)
    try:
        spec, why = choose(requested, where, installed=lambda module: module != "cupy" or nccl)
    except ValueError as exc:
        raise ConfigError(f"--train.weight_transport {exc}") from None
    return spec.name, why


class Transport(Protocol):
    """Moves the actor's weights into the engines as one version; ``parts`` says where the
    last sync's time went, as the driver saw it (``sync/{part}_s``): ``actor_send`` (the
    actor's call, until the sync object is back), ``actor_pack`` (inside it, rank 0 packing
    and sending: the rest is Ray's call), ``engine_calls`` (the engines' load calls, which
    hold their receive, validate, load and verify parts) and ``actor_release``; ``stats``
    is the sender's account of it (``sync/{key}``: a delta sender's ``bytes_sent``,
    ``bytes_full``, ``changed_fraction``, ``whole_buckets``)."""

    parts: dict[str, float]
    stats: dict[str, float]

    def sync(self, version: int) -> None: ...

    def close(self) -> None: ...


def load_alone(
    engine: RayEngine, *, actor: LearnerGroup, version: int, verify: bool | str, bucket_bytes: int
) -> int:
    """The actor's weights, stamped ``version``, into ``engine`` alone through the object
    store (whatever the run's transport); the sender is closed after. Returns the version."""
    try:
        sent = actor.send_weights(kind="object_store", version=version, bucket_bytes=bucket_bytes)
        return engine.update_weights_from(sent.sync, verify=verify)
    finally:
        actor.close_weight_sender("object_store")


@dataclass
class SenderTransport:
    """A sender in the actor's rank 0 makes a sync object; every engine receives it
    (object store, shared memory, CUDA IPC). The object store and shared memory keep the last
    sync (``last``: its buffers in the object store, the segment until the next sync) for an
    engine that replaces a dead one."""

    kind: str
    actor: LearnerGroup
    engines: list[RayEngine]
    verify: bool | str
    bucket_bytes: int
    parts: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    last: Any = None
    version: int | None = None
    """The version of the last sync (None before the first)."""
    on_engine_died: Callable[[int, RayEngine], object] | None = None
    """Called with (index, engine) for each engine found dead during a sync, once the others
    loaded it (`rlhf.cli.revive`: it starts a replacement, which loads this sync through
    `replace`); None: the death propagates."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _releasing: list[Any] = field(default_factory=list, repr=False)

    def sync(self, version: int) -> None:
        from ray.exceptions import RayActorError

        dead: list[tuple[int, RayEngine]] = []
        with self._lock:  # not while an engine that replaces a dead one loads the last sync
            self._released()
            tick = time.perf_counter()
            self.last = None
            sent = self.actor.send_weights(
                kind=self.kind, version=version, bucket_bytes=self.bucket_bytes
            )
            synced = sent.sync
            sent_at = time.perf_counter()
            for i, engine in enumerate(self.engines):
                try:
                    engine.update_weights_from(synced, verify=self.verify)
                except RayActorError:
                    if self.on_engine_died is None:
                        raise
                    dead.append((i, engine))
            loaded = time.perf_counter()
            self.version = version
            spec = transport(self.kind)
            if spec.rejoinable:
                self.last = synced
            if spec.release_after_load:  # every engine loaded: the CUDA IPC buffers may go
                self._releasing = self.actor.close_weight_sender(self.kind, wait=False)
        self.parts = {
            "actor_send": sent_at - tick,
            "actor_pack": sent.seconds,
            "engine_calls": loaded - sent_at,
            "actor_release": time.perf_counter() - loaded,
        }
        self.stats = dict(sent.metrics)
        for i, engine in dead:
            assert self.on_engine_died is not None
            self.on_engine_died(i, engine)

    def _released(self) -> None:
        """Wait for the last sync's release (CUDA IPC buffers dropped in the actor's rank 0,
        started without waiting: the actor runs its calls in order, so the next one comes
        after it); raises its error."""
        import ray

        releasing, self._releasing = self._releasing, []
        ray.get(releasing)

    def replace(self, index: int, engine: RayEngine) -> int:
        """Put ``engine`` in place of engine ``index`` (one that died) and load into it the
        weights the other engines hold: the last sync again (a rejoinable transport), else the
        actor's weights anew (`load_alone`); returns its weight version (that of the
        checkpoint, when no sync happened yet)."""
        with self._lock:
            self.engines[index] = engine
            if self.version is None:
                return engine.weight_version
            if transport(self.kind).rejoinable:
                return engine.update_weights_from(self.last, verify=self.verify)
            version = load_alone(
                engine, actor=self.actor, version=self.version, verify=self.verify,
                bucket_bytes=self.bucket_bytes,
            )  # fmt: skip
            # A new sender: its first sync goes whole (a delta sender's base is a sync the new
            # engine never received).
            self.actor.close_weight_sender(self.kind)
            return version

    def close(self) -> None:
        self._released()
        self.actor.close_weight_sender(self.kind)


@dataclass
class GroupTransport:
    """The actor's rank 0 and every engine form one group of a group transport (``kind``,
    the broadcast: rank 0 sends, engine ``i`` is rank ``i + 1``); each sync streams through
    it.

    A dead engine is found by the sync itself, before it sends (each engine answers a cheap
    call) or while it sends (rank 0's send fails). Rank 0 then leaves the group, which ends
    the live engines' receive at once (a gloo receive would otherwise wait for the group's
    timeout), ``on_engine_died`` starts a new engine in each dead one's place (`replace`),
    the group is formed anew and the sync is sent again. Without ``on_engine_died`` the
    dead engine's `rlhf.rollout.EngineDiedError` stops the run. An engine replaced between
    syncs (found dead by the pool) loads the actor's weights alone (`load_alone`) and joins
    the group formed anew at the next sync.
    """

    actor: LearnerGroup
    engines: list[RayEngine]
    verify: bool | str
    bucket_bytes: int
    kind: str = "broadcast"
    parts: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    version: int | None = None
    """The version of the last sync (None before the first)."""
    on_engine_died: Callable[[int, RayEngine], object] | None = None
    """Called with (index, engine) for an engine found dead by a sync (`rlhf.cli.revive`):
    it starts a replacement and puts it in place through `replace`; None: the death stops
    the sync."""
    answer_timeout_s: float = 60.0
    """How long a sync waits for an engine to answer the liveness call, and for a live
    engine's receive to end once rank 0 left the group."""
    _regroup: bool = field(default=False, repr=False)
    _sending: int | None = field(default=None, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __post_init__(self) -> None:
        self._form_group()

    def _form_group(self) -> None:
        import ray

        self.actor.close_weight_sender(self.kind)  # a former group's member
        group = self.actor.new_weight_group(kind=self.kind, world_size=1 + len(self.engines))
        joins = [
            e.join_weight_group(group, rank, self.kind) for rank, e in enumerate(self.engines, 1)
        ]
        self.actor.join_weight_group(kind=self.kind, group=group)
        ray.get(joins)

    def _dead(self, refs: Sequence[Any], *, must_end: bool) -> list[int]:
        """Indices of the engines whose call ``refs[i]`` ended with the actor's death
        (answers and other errors count as alive; so does a call still running after
        ``answer_timeout_s``, unless ``must_end``).

        Raises:
            WeightSyncError: with ``must_end``, an engine whose receive did not end.
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        from rlhf.weights import WeightSyncError

        dead = []
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=self.answer_timeout_s)
            except RayActorError:
                dead.append(i)
            except GetTimeoutError:
                if must_end:
                    raise WeightSyncError(
                        f"vLLM engine {i} was still receiving {self.answer_timeout_s:.0f} s "
                        "after the actor left the broadcast group"
                    ) from None
            except Exception:  # a live engine's ended receive
                continue
        return dead

    def _revive(self, dead: Sequence[int], cause: BaseException | None = None) -> None:
        """Engines ``dead`` replaced through ``on_engine_died`` (which calls `replace`), or
        the first one's `EngineDiedError` raised."""
        from ray.exceptions import ActorDiedError

        for i in dead:
            engine = self.engines[i]
            if self.on_engine_died is None:
                raise engine.died(cause or ActorDiedError()) from cause
            self.on_engine_died(i, engine)

    def _broadcast(self, version: int) -> None:
        """One sync over the group (formed anew first when an engine was replaced).

        Raises:
            _MemberDiedError: an engine died during it; rank 0 has left the group and every live
                engine's receive has ended.
        """
        import ray

        if self._regroup:
            self._form_group()
            self._regroup = False
        loads = [e.update_weights_from_group(verify=self.verify) for e in self.engines]
        tick = time.perf_counter()
        try:
            sent = self.actor.send_weights(  # the engines receive while it sends
                kind=self.kind, version=version, bucket_bytes=self.bucket_bytes
            )
            sent_at = time.perf_counter()
            ray.get(loads)
            self.parts = {
                "actor_send": sent_at - tick,
                "actor_pack": sent.seconds,
                "engine_calls": time.perf_counter() - sent_at,
            }
            self.stats = dict(sent.metrics)
        except Exception as exc:
            self.actor.close_weight_sender(self.kind)  # ends the receives
            self._regroup = True
            dead = self._dead(loads, must_end=True)
            if not dead:
                raise
            raise _MemberDiedError(dead) from exc

    def sync(self, version: int) -> None:
        # on_engine_died runs under this lock (the reviver then takes its own): revival over
        # a broadcast group is enabled only without --train.async_enable
        # (`rlhf.cli.revive.why_not_revivable`), where no pool request runs during a sync.
        with self._lock:
            self._sending = version
            try:
                self._revive(self._dead([e.ready() for e in self.engines], must_end=False))
                try:
                    self._broadcast(version)
                except _MemberDiedError as died:  # once more, with the replacements
                    self._revive(died.indices, died.__cause__)
                    try:
                        self._broadcast(version)
                    except _MemberDiedError as again:
                        engine = self.engines[again.indices[0]]
                        raise engine.died(again.__cause__ or again) from again
            finally:
                self._sending = None
            self.version = version

    def replace(self, index: int, engine: RayEngine) -> int:
        """Put ``engine`` in place of engine ``index`` (one that died) and form the group
        anew before the next broadcast; during a sync that broadcast brings it the sync's
        version, else it loads the actor's weights alone now (`load_alone`). Returns the
        version it holds (or is being sent)."""
        with self._lock:
            self.engines[index] = engine
            self._regroup = True
            if self._sending is not None:
                return self._sending
            if self.version is None:
                return engine.weight_version
            return load_alone(
                engine, actor=self.actor, version=self.version, verify=self.verify,
                bucket_bytes=self.bucket_bytes,
            )  # fmt: skip

    def close(self) -> None:
        self.actor.close_weight_sender(self.kind)


class _MemberDiedError(Exception):
    """Engines (by index) that died during a broadcast."""

    def __init__(self, indices: list[int]) -> None:
        super().__init__(f"engines {indices} died during the weight broadcast")
        self.indices = indices


_SYNC_PARTS = ("receive", "validate", "load", "verify")


def engine_sync_parts(engines: Sequence[RayEngine]) -> dict[str, float]:
    """Where the last sync's time went inside the engines (the slowest engine per part):
    ``sync/engine_{receive,validate,load,verify}_s`` — receiving the buckets, checking them,
    vLLM's weight loaders, the read-back check. ``load`` is the engine's own cost, the floor
    a transport is measured against."""
    from ray.exceptions import RayActorError

    seen = []
    for e in engines:
        try:
            seen.append(e.metrics())
        except RayActorError:  # died since it loaded: the pool revives it on its next request
            continue
    out: dict[str, float] = {}
    for part in _SYNC_PARTS:
        key = f"engine/last_sync_{part}_s"
        values = [m[key] for m in seen if key in m]
        if values:
            out[f"sync/engine_{part}_s"] = max(values)
    return out


def report(kind: str, why: str, engines: Sequence[RayEngine]) -> dict[str, Any]:
    """For ``run_dir/sync.json``: the transport, why it was chosen, and the syncs each engine
    loaded by the path they arrived on (what was used, as the engines saw it)."""
    return {"transport": kind, "why": why, "engines_loaded": [e.weight_loads() for e in engines]}


def open_transport(
    kind: str,
    *,
    actor: LearnerGroup,
    engines: list[RayEngine],
    verify: bool | str,
    bucket_bytes: int,
) -> Transport:
    """The `Transport` of ``kind`` (a `choose_transport` result) between the actor and the
    engines, set up (a broadcast group is formed here). ``engines`` is kept, not copied: an
    engine replaced in it (`SenderTransport.replace`) is replaced for its owner too."""
    if transport(kind).grouped:
        return GroupTransport(actor, engines, verify, bucket_bytes, kind=kind)
    return SenderTransport(kind, actor, engines, verify, bucket_bytes)
