"""A `VLLMEngine` in a Ray actor, and `RayEngine`, the `Generator` that talks to it.

One engine per actor process (vLLM keeps process-global parallel state). The actor is async:
generate calls from many callers overlap inside it. `RayEngine.run` executes a coroutine
function next to the engine (an rlhf.agents executor), so an episode's token stream never
leaves the engine's process; only the finished trajectories travel back.

Ray is imported when an actor is spawned; install ``rlhf-rollout[cpu]`` or ``[gpu]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlhf.agents import Generation, SamplingParams
from rlhf.rollout.buckets import WeightBucket
from rlhf.rollout.config import EngineConfig
from rlhf.rollout.engine import VLLMEngine
from rlhf.rollout.transports.cuda_ipc import CudaIpcSync, receive_cuda_ipc
from rlhf.rollout.transports.host import (
    SharedMemoryReceiver,
    SharedMemorySync,
    receive_shared_memory,
)


class EngineActor:
    """The actor body (wrapped with ``ray.remote`` by `spawn_engines`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = VLLMEngine(config).start()
        self.group: Any = None  # NcclGroup with the learner, once `init_weight_group` ran
        self.shm_receiver = SharedMemoryReceiver()

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Generation:
        return await self.engine.generate(prompt_token_ids, sampling)

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``await fn(engine, *args, **kwargs)`` inside the actor."""
        return await fn(self.engine, *args, **kwargs)

    async def update_weights(
        self, buckets: Sequence[Any], *, require_all: bool = True, verify: bool = False
    ) -> int:
        """Load a sync given as buckets, ``(header, buffer)`` pairs (the buffer may be an
        object ref), or object refs of either."""
        import ray

        resolved = []
        for item in buckets:  # awaited, not ray.get: requests keep flowing meanwhile
            item = await item if isinstance(item, ray.ObjectRef) else item
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], ray.ObjectRef):
                item = (item[0], await item[1])  # a header beside its buffer's ref
            resolved.append(item)
        return await asyncio.to_thread(
            self.engine.update_weights, resolved, require_all=require_all, verify=verify
        )

    async def update_weights_from_shared_memory(
        self, sync: SharedMemorySync, *, require_all: bool = True, verify: bool = False
    ) -> int:
        """Load a sync that the sender wrote into shared memory (`send_shared_memory`, or a
        `SharedMemoryChannel`, whose segment stays mapped here between syncs)."""

        def load() -> int:
            if sync.persistent:
                buckets = self.shm_receiver.buckets(sync)
                return self.engine.update_weights(buckets, require_all=require_all, verify=verify)
            with receive_shared_memory(sync) as buckets:
                return self.engine.update_weights(buckets, require_all=require_all, verify=verify)

        return await asyncio.to_thread(load)

    async def update_weights_from_cuda_ipc(
        self,
        sync: CudaIpcSync | Mapping[str, Any],
        *,
        require_all: bool = True,
        verify: bool = False,
    ) -> int:
        """Load a sync shared by CUDA IPC from a process on the same GPU."""

        def load() -> int:
            buckets = receive_cuda_ipc(sync)
            return self.engine.update_weights(buckets, require_all=require_all, verify=verify)

        return await asyncio.to_thread(load)

    async def init_weight_group(self, unique_id: Sequence[int], rank: int, world_size: int) -> None:
        """Join the learner's NCCL group (blocks until every rank has joined)."""
        from rlhf.rollout.transports.nccl import NcclGroup

        def join() -> None:
            if self.group is not None:
                self.group.close()
            self.group = NcclGroup(unique_id=unique_id, rank=rank, world_size=world_size)

        await asyncio.to_thread(join)

    async def update_weights_from_nccl(
        self,
        headers: Sequence[Any],
        *,
        require_all: bool = True,
        verify: bool = False,
    ) -> int:
        """Receive one broadcast buffer per header from the group's rank 0, then load."""
        if self.group is None:
            raise RuntimeError("call init_weight_group() before update_weights_from_nccl()")

        def load() -> int:
            buckets = self.group.receive_buckets(headers)
            return self.engine.update_weights(buckets, require_all=require_all, verify=verify)

        return await asyncio.to_thread(load)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A blocking `VLLMEngine` method (pause, resume, sleep, weight_checksums, …)."""
        if method.startswith("_") or method in ("start", "generate"):
            raise AttributeError(f"VLLMEngine.{method} cannot be called remotely")
        return await asyncio.to_thread(getattr(self.engine, method), *args, **kwargs)

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def weight_version(self) -> int:
        return self.engine.weight_version

    def shutdown(self) -> None:
        self.shm_receiver.close()
        if self.group is not None:
            self.group.close()
            self.group = None
        self.engine.shutdown()


class RayEngine:
    """A `Generator` backed by an `EngineActor`; cancelling `generate` cancels the remote call
    (and so the vLLM request).

    Args:
        handle: The actor handle.
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Generation:
        import ray

        ref = self.handle.generate.remote(list(prompt_token_ids), sampling)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``await fn(engine, *args, **kwargs)`` inside the actor process."""
        return await self.handle.run.remote(fn, *args, **kwargs)

    def update_weights(
        self,
        buckets: Sequence[WeightBucket | Any],
        *,
        require_all: bool = True,
        verify: bool = False,
    ) -> int:
        """Send buckets (or object refs of buckets) and load them; blocks until loaded."""
        import ray

        return ray.get(
            self.handle.update_weights.remote(list(buckets), require_all=require_all, verify=verify)
        )

    def update_weights_from_shared_memory(
        self, sync: SharedMemorySync, *, require_all: bool = True, verify: bool = False
    ) -> int:
        import ray

        return ray.get(
            self.handle.update_weights_from_shared_memory.remote(
                sync, require_all=require_all, verify=verify
            )
        )

    def update_weights_from_cuda_ipc(
        self,
        sync: CudaIpcSync | Mapping[str, Any],
        *,
        require_all: bool = True,
        verify: bool = False,
    ) -> int:
        """Load a sync shared by CUDA IPC (the sender keeps its buffers alive until this
        returns)."""
        import ray

        return ray.get(
            self.handle.update_weights_from_cuda_ipc.remote(
                sync, require_all=require_all, verify=verify
            )
        )

    def init_weight_group(self, unique_id: Sequence[int], rank: int, world_size: int) -> Any:
        """Start joining the learner's NCCL group; returns the call's object ref at once (the
        sender joins as rank 0 at the same time, then ``ray.get`` the refs)."""
        return self.handle.init_weight_group.remote(tuple(unique_id), rank, world_size)

    def update_weights_from_nccl(
        self, headers: Sequence[Any], *, require_all: bool = True, verify: bool = False
    ) -> Any:
        """Start receiving a sync over NCCL; returns the call's object ref at once (the sender
        then broadcasts the buffers; ``ray.get`` gives the new weight version)."""
        return self.handle.update_weights_from_nccl.remote(
            list(headers), require_all=require_all, verify=verify
        )

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a blocking `VLLMEngine` method in the actor (``pause``, ``resume``, …)."""
        import ray

        return ray.get(self.handle.call.remote(method, *args, **kwargs))

    def metrics(self) -> dict[str, float]:
        import ray

        return ray.get(self.handle.metrics.remote())

    def shutdown(self) -> None:
        import ray

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
    scheduling: Sequence[Any] | None = None,
) -> list[RayEngine]:
    """Start ``num_engines`` engine actors on the current Ray cluster and wait until ready.

    Args:
        config: Every engine's options; engine ``i`` gets seed ``config.seed + i``.
        num_engines: Actors to start.
        num_cpus: CPUs each actor reserves.
        num_gpus: GPUs each actor reserves (default ``tensor_parallel_size`` when the cluster
            has GPUs, else 0).
        env: Extra environment variables of the actor processes.
        max_concurrency: Concurrent calls an actor accepts.
        scheduling: One Ray scheduling strategy per engine (e.g. a placement-group bundle
            shared with learner ranks), or None.
    """
    import dataclasses

    import ray

    if num_engines < 1:
        raise ValueError(f"vllm.num_engines must be >= 1, got {num_engines}")
    if num_gpus is None:
        num_gpus = float(config.tensor_parallel_size) if ray.cluster_resources().get("GPU") else 0
    if scheduling is not None and len(scheduling) != num_engines:
        raise ValueError(f"scheduling has {len(scheduling)} entries for {num_engines} engines")
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "max_concurrency": max_concurrency,
        "runtime_env": {"env_vars": dict(env or {})},
    }
    actor = ray.remote(EngineActor)
    handles = [
        actor.options(  # type: ignore[attr-defined]
            **options, **({"scheduling_strategy": scheduling[i]} if scheduling else {})
        ).remote(dataclasses.replace(config, seed=config.seed + i))
        for i in range(num_engines)
    ]
    ray.get([h.weight_version.remote() for h in handles])  # raises if an engine failed to start
    return [RayEngine(h) for h in handles]
