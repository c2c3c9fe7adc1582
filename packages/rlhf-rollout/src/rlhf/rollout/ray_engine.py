"""A `VLLMEngine` in a Ray actor, and `RayEngine`, the handle that mirrors it.

One engine per actor process (vLLM keeps process-global parallel state). The actor is async:
generate calls from many callers overlap inside it, and blocking engine calls run in threads so
requests keep flowing meanwhile. `RayEngine` has `VLLMEngine`'s methods with the same
arguments (``generate``, ``generate_group``, ``pause``, ``resume``, ``sleep``, ``wake_up``,
``update_weights``, ``weight_checksums``, ``metrics``, ``shutdown``), blocking until the actor
answered, plus what only a remote engine needs: `RayEngine.run` executes a coroutine function
next to the engine (an rlhf.agents executor, so an episode's token stream never leaves the
engine's process), and weights arrive through an `rlhf.weights` transport
(`RayEngine.update_weights_from`, or a broadcast group: `RayEngine.join_weight_group` then
`RayEngine.update_weights_from_group`). `RayEngine.reset` resets the engine as
`VLLMEngine.reset` does and returns a new handle for the run that takes it over.

Ray is imported when an actor is spawned; install ``rlhf-rollout[cpu]`` or ``[gpu]``.
"""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar, cast

from rlhf.agents import Generation, SamplingParams
from rlhf.rollout.batching import Answer, Outcome, RequestBatcher, StreamedRequests
from rlhf.rollout.config import EngineConfig
from rlhf.rollout.engine import VLLMEngine
from rlhf.rollout.errors import EngineError
from rlhf.rollout.readback import LiveDigest
from rlhf.weights import GroupMember, WeightBucket, receivers, transport

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.util.scheduling_strategies import SchedulingStrategyT

P = ParamSpec("P")
T = TypeVar("T")

TransportSync = object
"""A sync that a sync-object transport's sender made for the engines to receive (its type
picks the receiver: `rlhf.weights.receivers`)."""


class EngineDiedError(EngineError):
    """An engine's actor died (killed, out of memory, its node lost) under a request: the
    engine is gone, not the request wrong, so the request may be re-issued on a live engine
    (`rlhf.rollout.EnginePool` does, given a ``revive`` hook).

    Attributes:
        actor_id: The dead actor's id (hex), or None.
    """

    def __init__(self, message: str, *, actor_id: str | None = None) -> None:
        super().__init__(message)
        self.actor_id = actor_id


class EngineActor:
    """The actor body (wrapped with ``ray.remote`` by `spawn_engines`)."""

    def __init__(self, config: EngineConfig) -> None:
        # `kill -USR1 <pid>` (the pids are in a run's placement.json) writes every thread's
        # stack to this actor's Ray log.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        self.engine = VLLMEngine(config).start()
        self._fresh_state()

    def _fresh_state(self) -> None:
        # One receiver per registered transport, by the type of sync it reads (kept: the
        # shared-memory receiver keeps the sender's segment mapped between syncs).
        self.receivers = receivers()
        self.group: tuple[str, GroupMember] | None = None  # a group transport's membership
        self.loads: dict[str, int] = {}  # syncs loaded, by the path they arrived on
        self.receive_s: float | None = None  # the last sync's transport receive
        self.streamed = StreamedRequests()

    def _close_transports(self) -> None:
        for _, receiver in self.receivers.values():
            receiver.close()
        self._close_group()

    def _close_group(self) -> None:
        if self.group is not None:
            self.group[1].close()
            self.group = None

    def _loaded(self, path: str, version: int) -> int:
        self.loads[path] = self.loads.get(path, 0) + 1
        return version

    async def generate_stream(
        self, call_id: str, requests: Sequence[tuple[int, list[int], SamplingParams, int | None]]
    ) -> AsyncIterator[list[Outcome]]:
        """Several requests in one call; their outcomes stream back as they finish
        (`rlhf.rollout.batching`)."""
        async for outcomes in self.streamed.stream(call_id, requests, self._generate):
            yield outcomes

    async def _generate(self, ids: list[int], sampling: SamplingParams, n: int | None) -> Answer:
        if n is None:
            return await self.engine.generate(ids, sampling)
        return await self.engine.generate_group(ids, sampling, n)

    async def abort_requests(self, call_id: str, indices: Sequence[int]) -> None:
        self.streamed.abort(call_id, indices)  # on the actor's event loop, with the requests

    async def run(
        self,
        fn: Callable[Concatenate[VLLMEngine, P], Awaitable[T]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """``await fn(engine, *args, **kwargs)`` inside the actor."""
        return await fn(self.engine, *args, **kwargs)

    async def _blocking(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def pause(self) -> int:
        return await self._blocking(self.engine.pause)

    async def resume(self) -> int:
        return await self._blocking(self.engine.resume)

    async def sleep(self, level: int = 1) -> None:
        await self._blocking(self.engine.sleep, level)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        await self._blocking(self.engine.wake_up, tags)

    async def update_weights(
        self,
        buckets: Sequence[WeightBucket],
        *,
        require_all: bool = True,
        verify: bool | str = False,
    ) -> int:
        version = await self._blocking(
            self.engine.update_weights, buckets, require_all=require_all, verify=verify
        )
        return self._loaded("buckets", version)

    async def update_weights_from(
        self, sync: TransportSync, *, require_all: bool = True, verify: bool | str = False
    ) -> int:
        if type(sync) not in self.receivers:
            known = ", ".join(t.__name__ for t in self.receivers)
            raise TypeError(f"no receiver for a {type(sync).__name__}; known: {known}")
        path, receiver = self.receivers[type(sync)]

        def load() -> int:
            tick = time.perf_counter()
            buckets = receiver.receive(sync)
            self.receive_s = time.perf_counter() - tick
            return self.engine.update_weights(buckets, require_all=require_all, verify=verify)

        return self._loaded(path, await self._blocking(load))

    async def join_weight_group(self, group: object, rank: int, kind: str = "broadcast") -> None:
        join_group = transport(kind).join
        if join_group is None:
            raise TypeError(f"{kind} is not a group transport")

        def join() -> None:
            self._close_group()
            self.group = (kind, join_group(group, rank=rank))

        await self._blocking(join)

    async def update_weights_from_group(
        self, *, require_all: bool = True, verify: bool | str = False
    ) -> int:
        if self.group is None:
            raise RuntimeError("join_weight_group() before update_weights_from_group()")
        kind, member = self.group

        def load() -> int:
            tick = time.perf_counter()
            buckets = member.receive()
            self.receive_s = time.perf_counter() - tick
            return self.engine.update_weights(buckets, require_all=require_all, verify=verify)

        return self._loaded(kind, await self._blocking(load))

    def weight_loads(self) -> dict[str, int]:
        return dict(self.loads)

    async def weight_checksums(self, algorithm: str = "blake2b-128") -> dict[str, list[LiveDigest]]:
        return await self._blocking(self.engine.weight_checksums, algorithm)

    def metrics(self) -> dict[str, float]:
        out = self.engine.metrics()
        if self.receive_s is not None:  # the last sync's transport, up to bucket validation
            out["engine/last_sync_receive_s"] = self.receive_s
        return out

    def weight_version(self) -> int:
        return self.engine.weight_version

    async def reset(self) -> None:
        """`VLLMEngine.reset`, and the actor as at its start: its receivers and broadcast
        group closed and made anew, no sync counted, no stream open."""

        def reset() -> None:
            self._close_transports()
            self.engine.reset()
            self._fresh_state()

        await self._blocking(reset)

    def shutdown(self) -> None:
        self._close_transports()
        self.engine.shutdown()


def _actor_env(config: EngineConfig, env: Mapping[str, str] | None, *, gpu: bool) -> dict[str, str]:
    """The actor's environment: ``env``, and on CPUs with an eager engine torch.compile off
    (``TORCH_COMPILE_DISABLE=1``, unless ``env`` sets it). Such an engine compiles nothing but
    one small sampler op (vLLM's log-prob rank count), whose first call took 2.3–2.8 s at every
    start on a 2-core machine, for no measurable gain afterwards; TorchDynamo's switch is
    per thread, so only the environment reaches the engine's step thread."""
    out = dict(env or {})
    if not gpu and config.eager_on_cpu:
        out.setdefault("TORCH_COMPILE_DISABLE", "1")
    return out


class RayEngine:
    """A `VLLMEngine` in an `EngineActor`: the same methods, blocking until the actor answered
    (``generate`` and ``run`` are coroutines; the ``generate`` calls of one event-loop turn
    travel in one actor call, and cancelling one aborts its vLLM request).

    Args:
        handle: The actor handle.
    """

    def __init__(self, handle: ActorHandle[EngineActor]) -> None:
        self.handle = handle
        self.batcher = RequestBatcher(handle)

    def ready(self) -> ObjectRef[int]:
        """An object ref that resolves once the engine has started (and raises if it failed
        to): for starting engines side by side with other processes."""
        return self.handle.weight_version.remote()

    @staticmethod
    def _get(ref: ObjectRef[T]) -> T:
        import ray

        return ray.get(ref)

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Generation:
        """One request; the requests of one event-loop turn share one actor call
        (`rlhf.rollout.batching`).

        Raises:
            EngineDiedError: the actor died before answering (Ray's ``RayActorError``, e.g.
                ``ActorDiedError`` or ``ActorUnavailableError``, is its ``__cause__``).
        """
        from ray.exceptions import RayActorError

        try:
            return await self.batcher.generate(prompt_token_ids, sampling)
        except RayActorError as exc:
            raise self.died(exc) from exc

    async def generate_group(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams, n: int
    ) -> list[Generation]:
        """`VLLMEngine.generate_group`: ``n`` samples of one prompt as one engine request,
        batched with the other requests of the event-loop turn as `generate` is.

        Raises:
            EngineDiedError: as `generate`.
        """
        from ray.exceptions import RayActorError

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        try:
            return await self.batcher.generate_group(prompt_token_ids, sampling, n)
        except RayActorError as exc:
            raise self.died(exc) from exc

    def died(self, exc: BaseException) -> EngineDiedError:
        """The `EngineDiedError` for Ray's report ``exc`` of this engine's actor dying."""
        actor_id = getattr(exc, "actor_id", None) or self.actor_id
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        return EngineDiedError(
            f"the vLLM engine actor {actor_id} (class_name: EngineActor) died: {first[:200]}",
            actor_id=actor_id,
        )

    @property
    def actor_id(self) -> str:
        """The actor's id (hex), as Ray's errors and runtime context name it."""
        return self.handle._actor_id.hex()

    async def run(
        self,
        fn: Callable[Concatenate[VLLMEngine, P], Awaitable[T]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """Run ``await fn(engine, *args, **kwargs)`` inside the actor process."""
        # Ray types an actor handle's methods as Never; this call's ref resolves to fn's result.
        return await cast("ObjectRef[T]", self.handle.run.remote(fn, *args, **kwargs))

    def pause(self) -> int:
        """`VLLMEngine.pause`."""
        return self._get(self.handle.pause.remote())

    def resume(self) -> int:
        """`VLLMEngine.resume`."""
        return self._get(self.handle.resume.remote())

    def sleep(self, level: int = 1) -> None:
        """`VLLMEngine.sleep`."""
        self._get(self.handle.sleep.remote(level))

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """`VLLMEngine.wake_up`."""
        self._get(self.handle.wake_up.remote(None if tags is None else list(tags)))

    def update_weights(
        self,
        buckets: Sequence[WeightBucket],
        *,
        require_all: bool = True,
        verify: bool | str = False,
    ) -> int:
        """`VLLMEngine.update_weights` with buckets sent along with the call."""
        return self._get(
            self.handle.update_weights.remote(list(buckets), require_all=require_all, verify=verify)
        )

    def update_weights_from(
        self, sync: TransportSync, *, require_all: bool = True, verify: bool | str = False
    ) -> int:
        """Receive a transport's sync (`rlhf.weights`: object store, shared memory, CUDA IPC)
        in the actor and load it as `update_weights` does; the sender keeps the sync's
        buffers until this returns."""
        return self._get(
            self.handle.update_weights_from.remote(sync, require_all=require_all, verify=verify)
        )

    def join_weight_group(
        self, group: object, rank: int, kind: str = "broadcast"
    ) -> ObjectRef[None]:
        """Start joining ``group`` (the spec of a new group of the group transport ``kind``)
        as ``rank`` (>= 1); returns the call's object ref at once: the sender joins as rank 0
        meanwhile, then ``ray.get`` the refs."""
        return self.handle.join_weight_group.remote(group, rank, kind)

    def update_weights_from_group(
        self, *, require_all: bool = True, verify: bool | str = False
    ) -> ObjectRef[int]:
        """Start receiving the group's next sync; returns the call's object ref at once (the
        sender then broadcasts; ``ray.get`` gives the new weight version)."""
        return self.handle.update_weights_from_group.remote(require_all=require_all, verify=verify)

    def weight_checksums(self, algorithm: str = "blake2b-128") -> dict[str, list[LiveDigest]]:
        """`VLLMEngine.weight_checksums`."""
        return self._get(self.handle.weight_checksums.remote(algorithm))

    @property
    def weight_version(self) -> int:
        """`VLLMEngine.weight_version`."""
        return self._get(self.handle.weight_version.remote())

    def weight_loads(self) -> dict[str, int]:
        """Syncs this engine loaded, by the path they arrived on: ``buckets``
        (`update_weights`), ``object_store``, ``shared_memory``, ``cuda_ipc``, ``broadcast``."""
        return self._get(self.handle.weight_loads.remote())

    def metrics(self) -> dict[str, float]:
        """`VLLMEngine.metrics`, and after a sync through a transport
        ``engine/last_sync_receive_s`` (its buckets received, before validation)."""
        return self._get(self.handle.metrics.remote())

    def reset(self) -> RayEngine:
        """`EngineActor.reset` (the engine serves as a freshly started one would: see
        `VLLMEngine.reset`); returns a new handle on the same actor, with a request batcher of
        its own, for the run that takes the engine over.

        Raises:
            EngineDiedError: the actor died.
        """
        from ray.exceptions import RayActorError

        try:
            self._get(self.handle.reset.remote())
        except RayActorError as exc:
            raise self.died(exc) from exc
        return RayEngine(self.handle)

    def shutdown(self) -> None:
        """Stop the engine and end the actor (one that already died is only released)."""
        import contextlib

        import ray
        from ray.exceptions import RayActorError

        # One that died under the run (killed, out of memory) has nothing left to stop.
        with contextlib.suppress(RayActorError):
            ray.get(self.handle.shutdown.remote())
        ray.kill(self.handle)


def spawn_engines(
    config: EngineConfig,
    num_engines: int,
    *,
    num_cpus: float = 1.0,
    num_gpus: float | None = None,
    env: Mapping[str, str] | None = None,
    max_concurrency: int = 1000,
    scheduling: Sequence[SchedulingStrategyT] | None = None,
    wait: bool = True,
) -> list[RayEngine]:
    """Start ``num_engines`` engine actors on the current Ray cluster and wait until ready.

    Args:
        config: Every engine's options; engine ``i`` gets seed ``config.seed + i``.
        num_engines: Actors to start.
        num_cpus: CPUs each actor reserves.
        num_gpus: GPUs each actor reserves (default the engine's ``world_size`` when the cluster
            has GPUs, else 0).
        env: Extra environment variables of the actor processes.
        max_concurrency: Concurrent calls an actor accepts.
        scheduling: One Ray scheduling strategy per engine (e.g. a placement-group bundle
            shared with learner ranks), or None.
        wait: Block until every engine has started; False returns at once (wait on
            `RayEngine.ready` then, e.g. while learner processes start too).
    """
    import dataclasses

    import ray

    if num_engines < 1:
        raise ValueError(f"vllm.num_engines must be >= 1, got {num_engines}")
    if num_gpus is None:
        num_gpus = float(config.world_size) if ray.cluster_resources().get("GPU") else 0
    if scheduling is not None and len(scheduling) != num_engines:
        raise ValueError(f"scheduling has {len(scheduling)} entries for {num_engines} engines")
    options: dict[str, object] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "max_concurrency": max_concurrency,
        "runtime_env": {"env_vars": _actor_env(config, env, gpu=num_gpus > 0)},
    }
    actor = ray.remote(EngineActor)
    # Ray types `.remote()` as `ActorHandle[T] | type[T]` (the class for editors' method
    # completion); what it returns is the handle.
    handles = [
        cast(
            "ActorHandle[EngineActor]",
            actor.options(  # type: ignore[attr-defined]
                **options, **({"scheduling_strategy": scheduling[i]} if scheduling else {})
            ).remote(dataclasses.replace(config, seed=config.seed + i)),
        )
        for i in range(num_engines)
    ]
    engines = [RayEngine(h) for h in handles]
    if wait:
        ray.get([e.ready() for e in engines])  # raises if an engine failed to start
    return engines
