"""Driving a sync: a learner's weights into every inference engine, one version at a time,
over a `rlhf.weights` transport, and what to do when an engine dies during one.

A run holds one `Transport` (`open_transport` makes it for a registered transport's name):

- `SenderTransport` (object store, shared memory, CUDA IPC): the learner's sender makes one
  sync object per version and every engine loads it; the rejoinable transports keep the last
  one for an engine that replaces a dead one (`SenderTransport.replace`).
- `GroupTransport` (broadcast, gloo or NCCL): the learner's rank 0 and the engines form one
  group and each sync streams through it; a dead engine is found before or during the
  broadcast, replaced through ``on_engine_died``, and the group formed anew.

The two ends are protocols, so any trainer and any engine that speak them can be driven:
`WeightSource` (what a learner group offers: `rlhf.learner.LearnerGroup`) and `WeightSink`
(what an engine handle offers: `rlhf.rollout.RayEngine`). Ray is imported only by the calls
that wait on engine actors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from rlhf.weights.format import WeightSyncError
from rlhf.weights.registry import transport


class SentSync(Protocol):
    """A learner's send of one sync: ``sync`` (the object the engines load, or a group
    transport's count of buckets sent), ``seconds`` (packing and sending) and the sender's
    ``metrics`` (`rlhf.weights.Measured`)."""

    @property
    def sync(self) -> object: ...

    @property
    def seconds(self) -> float: ...

    @property
    def metrics(self) -> Mapping[str, float]: ...


class WeightSource(Protocol):
    """The learner's side: streams its weights into its rank 0's sender of a transport."""

    def send_weights(self, *, kind: str, version: int, bucket_bytes: int) -> SentSync: ...

    def close_weight_sender(self, kind: str, *, wait: bool = True) -> list[Any]: ...

    def new_weight_group(self, *, kind: str, world_size: int) -> object: ...

    def join_weight_group(self, *, kind: str, group: object) -> None: ...


class WeightSink(Protocol):
    """An engine's side (a handle on an engine actor): loads a sync object or a group's next
    sync, answers a liveness call, and says which error its death is."""

    def update_weights_from(self, sync: Any, *, verify: bool | str = False) -> int: ...

    def update_weights_from_group(self, *, verify: bool | str = False) -> Any: ...

    def join_weight_group(self, group: object, rank: int, kind: str = "broadcast") -> Any: ...

    def ready(self) -> Any: ...

    def died(self, exc: BaseException) -> BaseException: ...

    @property
    def weight_version(self) -> int: ...

    def metrics(self) -> dict[str, float]: ...

    def weight_loads(self) -> dict[str, int]: ...


E = TypeVar("E", bound=WeightSink)
"""The engines' type, kept through a transport (a replacement is one of them)."""


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
    engine: WeightSink, *, actor: WeightSource, version: int, verify: bool | str, bucket_bytes: int
) -> int:
    """The actor's weights, stamped ``version``, into ``engine`` alone through the object
    store (whatever the run's transport); the sender is closed after. Returns the version."""
    try:
        sent = actor.send_weights(kind="object_store", version=version, bucket_bytes=bucket_bytes)
        return engine.update_weights_from(sent.sync, verify=verify)
    finally:
        actor.close_weight_sender("object_store")


@dataclass
class SenderTransport(Generic[E]):
    """A sender in the actor's rank 0 makes a sync object; every engine receives it
    (object store, shared memory, CUDA IPC). The object store and shared memory keep the last
    sync (``last``: its buffers in the object store, the segment until the next sync) for an
    engine that replaces a dead one."""

    kind: str
    actor: WeightSource
    engines: list[E]
    verify: bool | str
    bucket_bytes: int
    parts: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    last: Any = None
    version: int | None = None
    """The version of the last sync (None before the first)."""
    on_engine_died: Callable[[int, E], object] | None = None
    """Called with (index, engine) for each engine found dead during a sync, once the others
    loaded it (a reviver, such as `rlhf.cli.revive`'s: it starts a replacement, which loads
    this sync through `replace`); None: the death propagates."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _releasing: list[Any] = field(default_factory=list, repr=False)

    def sync(self, version: int) -> None:
        from ray.exceptions import RayActorError

        dead: list[tuple[int, E]] = []
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

    def replace(self, index: int, engine: E) -> int:
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
class GroupTransport(Generic[E]):
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

    actor: WeightSource
    engines: list[E]
    verify: bool | str
    bucket_bytes: int
    kind: str = "broadcast"
    parts: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    version: int | None = None
    """The version of the last sync (None before the first)."""
    on_engine_died: Callable[[int, E], object] | None = None
    """Called with (index, engine) for an engine found dead by a sync (a reviver, such as
    `rlhf.cli.revive`'s: it starts a replacement and puts it in place through `replace`);
    None: the death stops the sync."""
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
        # on_engine_died runs under this lock (the reviver then takes its own): revive over a
        # broadcast group only where no generation request runs during a sync (the CLI: not
        # under --train.async_enable, `rlhf.cli.revive.why_not_revivable`).
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

    def replace(self, index: int, engine: E) -> int:
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


def engine_sync_parts(engines: Sequence[WeightSink]) -> dict[str, float]:
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


def sync_report(kind: str, why: str, engines: Sequence[WeightSink]) -> dict[str, Any]:
    """The transport, why it was chosen, and the syncs each engine loaded by the path they
    arrived on (what was used, as the engines saw it)."""
    return {"transport": kind, "why": why, "engines_loaded": [e.weight_loads() for e in engines]}


def open_transport(
    kind: str,
    *,
    actor: WeightSource,
    engines: list[E],
    verify: bool | str,
    bucket_bytes: int,
) -> SenderTransport[E] | GroupTransport[E]:
    """The `Transport` of ``kind`` (a `choose_transport` result) between the actor and the
    engines, set up (a broadcast group is formed here). ``engines`` is kept, not copied: an
    engine replaced in it (`SenderTransport.replace`) is replaced for its owner too."""
    if transport(kind).grouped:
        return GroupTransport(actor, engines, verify, bucket_bytes, kind=kind)
    return SenderTransport(kind, actor, engines, verify, bucket_bytes)
