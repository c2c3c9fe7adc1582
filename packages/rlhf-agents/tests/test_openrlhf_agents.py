"""OpenRLHF 0.11 agent files (`rlhf.agents.openrlhf`): token-in-token-out episodes on a real LM."""

import asyncio
import textwrap

import pytest

from rlhf.agents import EnvironmentStepError, FailurePolicy, SamplingParams, load_module
from rlhf.agents.openrlhf import OpenRLHFAgentRunner

QUESTION = "Guess a number between 0 and 9: "


def runner(module, tokenizer, generator, **kw) -> OpenRLHFAgentRunner:
    # Every token stops a generation: one token per turn, so episodes take several turns
    # (OpenRLHF gives each turn the whole remaining budget).
    every = tuple(range(len(tokenizer)))
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=every)
    defaults = {"sampling": sampling, "max_len": 64}
    return OpenRLHFAgentRunner(
        executor=module.AgentExecutor(), source="AgentExecutor in test", tokenizer=tokenizer,
        generator=generator, **{**defaults, **kw},
    )  # fmt: skip


def run(ex, prompts, labels, n=1, seed=None):
    return asyncio.run(ex.run(prompts=prompts, labels=labels, n_samples_per_prompt=n, seed=seed))


def test_an_openrlhf_agent_file_runs_token_in_token_out(tokenizer, generator, examples) -> None:
    module = load_module(str(examples / "openrlhf_agent_guess.py"), purpose="test")
    result = run(runner(module, tokenizer, generator), [QUESTION, QUESTION], ["3", "7"], n=2)
    assert len(result.trajectories) == 4
    prompt_ids = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    feedback = {
        tuple(tokenizer(t, add_special_tokens=False)["input_ids"])
        for t in ("\nAnswer with a number: ", "\nToo low: ", "\nToo high: ")
    }
    for tr in result.trajectories:
        assert list(tr.token_ids[: tr.prompt_length]) == prompt_ids
        # Every action is a generation exactly as sampled, with its log-probs; every gap
        # between actions is one of the agent's feedback texts, encoded.
        calls = [(p, g) for p, g in generator.calls if list(p) == list(tr.token_ids[: len(p)])]
        spans, i, mask = [], tr.prompt_length, tr.action_mask
        while i < len(mask):
            j = i
            while j < len(mask) and mask[j] == mask[i]:
                j += 1
            spans.append((mask[i], i, j))
            i = j
        actions = [(a, b) for m, a, b in spans if m]
        gaps = [tuple(tr.token_ids[a:b]) for m, a, b in spans if not m]
        assert set(gaps) <= feedback and 1 <= len(actions) <= 3
        for a, b in actions:  # an engine call on exactly the stream so far returned it
            assert any(
                len(p) == a
                and g.token_ids == tr.token_ids[a:b]
                and g.logprobs == tr.rollout_logprobs[a:b]
                for p, g in calls
            ), (a, b)
        assert tr.reward == tr.score and tr.reward in (0.0, 1.0)
        assert tr.metrics["guesses"] == tr.metrics["turns"] == len(actions)
    assert (
        result.metrics["env/guesses_mean"]
        == sum(t.metrics["guesses"] for t in result.trajectories) / 4
    )


def test_a_steps_sampling_params_reach_the_next_generation(tokenizer, generator, examples) -> None:
    module = load_module(str(examples / "openrlhf_agent_guess.py"), purpose="test")
    before = len(generator.calls)
    seen: list[SamplingParams] = []
    original = generator.generate

    async def recording(prompt, sampling):
        seen.append(sampling)
        return await original(prompt, sampling)

    generator.generate = recording
    try:
        result = run(runner(module, tokenizer, generator), [QUESTION], ["12345"], seed=5)
    finally:
        del generator.generate
    assert len(generator.calls) - before == len(seen) == 3  # one token never reads 12345
    assert [s.temperature for s in seen] == [1.0, 0.5, 0.5]
    # Each turn's budget is what the episode has left (OpenRLHF's max_length rule).
    tr = result.trajectories[0]
    assert seen[0].max_new_tokens == 64 - tr.prompt_length
    assert seen[0].seed is not None and len({s.seed for s in seen}) == 1


BROKEN = """
from rlhf.agents.openrlhf import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": float("nan"), "environment_feedback": "", "done": True}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_a_failing_agent_is_named_or_skipped_by_policy(tmp_path, tokenizer, generator) -> None:
    path = tmp_path / "broken.py"
    path.write_text(textwrap.dedent(BROKEN))
    module = load_module(str(path), purpose="test")
    with pytest.raises(EnvironmentStepError, match=r"AgentExecutor in test \(prompt 0, sample 0\)"):
        run(runner(module, tokenizer, generator), [QUESTION], ["1"])
    skip = runner(module, tokenizer, generator, policy=FailurePolicy(on_failure="skip"))
    result = run(skip, [QUESTION], ["1"], n=2)
    assert result.trajectories == [] and result.metrics["env/skipped"] == 2.0
