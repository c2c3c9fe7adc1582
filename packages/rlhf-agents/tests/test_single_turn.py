"""Single-turn executor with a real tokenizer, a tiny transformers LM and a real reward file."""

import asyncio
import textwrap

import pytest
import torch

from rlhf.agents import FailurePolicy, FunctionReward, SamplingParams, SingleTurnExecutor


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


@pytest.fixture
def counting_reward(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(
        textwrap.dedent(
            """
            CALLS = []
            def reward_func(queries, prompts, labels, responses, **kwargs):
                CALLS.append(len(queries))
                return {"rewards": [float(len(r)) for r in responses], "extra_logs": {"chars": [len(r) for r in responses]}}
            """
        )
    )
    return FunctionReward.from_file(str(path))


def test_token_streams_masks_and_logprobs_are_exact(
    tokenizer, model, generator, counting_reward
) -> None:
    prompts = [chat(tokenizer, "What is 3 plus 4?"), chat(tokenizer, "Guess a number")]
    executor = SingleTurnExecutor(
        tokenizer=tokenizer,
        generator=generator,
        reward=counting_reward,
        sampling=SamplingParams(max_new_tokens=8, temperature=1.0),
        max_len=64,
    )
    result = asyncio.run(executor.run(prompts=prompts, labels=["7", "3"], n_samples_per_prompt=3))
    trajectories = result.trajectories
    assert [(t.prompt_index, t.sample_index) for t in trajectories] == [
        (p, s) for p in range(2) for s in range(3)
    ]
    assert counting_reward.func.__globals__["CALLS"] == [6]  # one batched call
    generated = {tuple(prompt) + g.token_ids: g for prompt, g in generator.calls}
    for t in trajectories:
        prompt_ids = tokenizer.encode(prompts[t.prompt_index], add_special_tokens=False)
        assert list(t.token_ids[: t.prompt_length]) == prompt_ids
        g = generated[t.token_ids]
        assert t.token_ids[t.prompt_length :] == g.token_ids
        assert t.action_mask == (0,) * t.prompt_length + (1,) * len(g.token_ids)
        assert t.rollout_logprobs[t.prompt_length :] == g.logprobs
        assert t.reward == float(len(tokenizer.decode(list(g.token_ids), skip_special_tokens=True)))
        assert t.truncated == (g.finish_reason == "length")
        # The sampler's log-probs sit on the tokens they score: a full forward agrees.
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([list(t.token_ids)])).logits[0].float(), -1)
        banned = generator.banned
        for pos in range(t.prompt_length, len(t.token_ids)):
            row = logp[pos - 1].clone()
            row[banned] = float("-inf")
            expected = torch.log_softmax(row, -1)[t.token_ids[pos]].item()
            assert t.rollout_logprobs[pos] == pytest.approx(expected, abs=1e-4)
    assert result.metrics["rollout/samples"] == 6
    assert result.metrics["rollout/dropped"] == 0


def test_long_prompts_are_left_truncated(tokenizer, generator, counting_reward) -> None:
    long_prompt = chat(tokenizer, " ".join(f"What is {i} plus {i}?" for i in range(30)))
    ids = tokenizer.encode(long_prompt, add_special_tokens=False)
    executor = SingleTurnExecutor(
        tokenizer=tokenizer,
        generator=generator,
        reward=counting_reward,
        sampling=SamplingParams(max_new_tokens=4),
        max_len=40,
    )
    result = asyncio.run(executor.run(prompts=[long_prompt], labels=[None]))
    (t,) = result.trajectories
    assert len(ids) > 36
    assert t.prompt_length == 36
    assert list(t.token_ids[:36]) == ids[-36:]
    assert result.metrics["rollout/prompts_truncated"] == 1


def test_skipped_rewards_drop_samples_and_are_counted(tmp_path, tokenizer, generator) -> None:
    path = tmp_path / "reward.py"
    path.write_text(
        "def reward_func(q, p, labels, **kw):\n    return [float('nan') if l == 'bad' else 1.0 for l in labels]\n"
    )
    scorer = FunctionReward.from_file(str(path), policy=FailurePolicy(on_failure="skip"))
    executor = SingleTurnExecutor(
        tokenizer=tokenizer,
        generator=generator,
        reward=scorer,
        sampling=SamplingParams(max_new_tokens=3),
        max_len=64,
    )
    prompts = [chat(tokenizer, "a"), chat(tokenizer, "b")]
    result = asyncio.run(
        executor.run(prompts=prompts, labels=["ok", "bad"], n_samples_per_prompt=2)
    )
    assert [t.prompt_index for t in result.trajectories] == [0, 0]
    assert result.metrics["rollout/dropped"] == 2
    assert result.metrics["reward/failed"] == 2


def test_executor_rejects_a_budget_without_room(tokenizer, generator, counting_reward) -> None:
    with pytest.raises(ValueError, match="max_len=8 must exceed sampling.max_new_tokens=8"):
        SingleTurnExecutor(
            tokenizer=tokenizer,
            generator=generator,
            reward=counting_reward,
            sampling=SamplingParams(max_new_tokens=8),
            max_len=8,
        )
    executor = SingleTurnExecutor(
        tokenizer=tokenizer,
        generator=generator,
        reward=counting_reward,
        sampling=SamplingParams(max_new_tokens=2),
        max_len=8,
    )
    with pytest.raises(ValueError, match="got 2 prompts but 1 labels"):
        asyncio.run(executor.run(prompts=["a", "b"], labels=[1]))


def test_samples_failing_together_raise_once_and_leave_no_unretrieved_exception():
    """Two samples that fail in the same step (the engine under both died): the first error is
    raised and asyncio has nothing left to report as "never retrieved"."""
    import gc

    from rlhf.agents._aio import gather_or_cancel

    reported: list[dict] = []

    async def fails(n: int) -> int:
        await asyncio.sleep(0)
        raise RuntimeError(f"engine died under sample {n}")

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx))
        with pytest.raises(RuntimeError, match="engine died under sample"):
            await gather_or_cancel([fails(0), fails(1), fails(2)])
        gc.collect()  # unretrieved task exceptions are reported when the task is collected
        await asyncio.sleep(0)

    # Collect earlier tests' garbage first, outside any loop: an HTTP client left to the
    # collector schedules its close on whatever loop runs when it is collected, and that
    # task's failure would be reported here.
    gc.collect()
    asyncio.run(main())
    assert reported == []
