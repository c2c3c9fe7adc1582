"""OpenRLHF 0.11 agent files (`rlhf.agents.openrlhf`): token-in-token-out episodes on a real LM."""

import asyncio
import dataclasses
import textwrap
import threading

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
    assert result.failure.startswith("AgentExecutor in test (prompt 0, sample 0): execute()")


class LoopBound:
    """A generator bound to the event loop the rollout runs on (the test's, on this thread), as
    the engine pool's calls are, that numbers its generations as weight versions (0, 1, ...)."""

    def __init__(self, inner) -> None:
        self.inner, self.versions = inner, 0

    async def generate(self, prompt, sampling):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("generate was called from another thread's event loop")
        generation = await self.inner.generate(prompt, sampling)
        self.versions += 1
        return dataclasses.replace(generation, weight_version=self.versions - 1)


def test_an_openai_server_executor_runs_token_in_token_out(tokenizer, generator, examples) -> None:
    # OpenRLHF's OpenAI-server shape: the executor keeps the first llm_engine and calls it
    # from its own HTTP server's thread; every episode goes through the openai client.
    module = load_module(str(examples / "openrlhf_agent_openai_server.py"), purpose="test")
    bound = LoopBound(generator)
    ex = runner(module, tokenizer, bound)
    result = run(ex, [QUESTION, QUESTION], ["3", "7"], n=2)
    assert len(result.trajectories) == 4 and result.metrics["env/failed"] == 0.0
    prompt_ids = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    retry = tuple(tokenizer(":", add_special_tokens=False)["input_ids"])
    for tr in result.trajectories:
        assert list(tr.token_ids[: tr.prompt_length]) == prompt_ids
        actions = [i for i, m in enumerate(tr.action_mask) if m]
        # One token per turn (every token stops a generation), ":" between two turns.
        assert len(actions) == tr.metrics["tries"] == tr.metrics["turns"] in (1.0, 2.0)
        if len(actions) == 2:
            assert tuple(tr.token_ids[actions[0] + 1 : actions[1]]) == retry
        for a in actions:  # an engine call on exactly the stream so far returned it
            assert any(
                list(p) == list(tr.token_ids[:a])
                and g.token_ids == tr.token_ids[a : a + 1]
                and g.logprobs == tr.rollout_logprobs[a : a + 1]
                for p, g in generator.calls
            ), a
        answer = tokenizer.decode(tr.token_ids[actions[-1] : actions[-1] + 1]).strip()
        label = "3" if tr.prompt_index == 0 else "7"
        assert tr.score == float(answer == label)
        assert tr.reward == (1.0 / len(actions) if answer == label else 0.0)
        assert tr.weight_version is not None and 0 <= tr.weight_version < bound.versions
    # Alone, an episode's version is the oldest of its generations: its first.
    # (A run is one event loop: the next is a new runner, its executor a new client.)
    before = bound.versions
    alone = run(runner(module, tokenizer, bound), [QUESTION], ["12345"]).trajectories[
        0
    ]  # one token never reads 12345
    assert alone.metrics["tries"] == 2.0 and bound.versions == before + 2
    assert alone.weight_version == before


def test_an_unchanged_openrlhf_import_says_which_line_to_change(tmp_path) -> None:
    path = tmp_path / "agent.py"
    path.write_text("from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n")
    with pytest.raises(ImportError, match=r"imports OpenRLHF's openrlhf: import .* from "
                       r"rlhf\.agents\.openrlhf instead"):  # fmt: skip
        load_module(str(path), purpose="agent")


SLOW = """
import asyncio

from rlhf.agents.openrlhf import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        await asyncio.sleep(3600)  # an environment that never answers

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_a_step_that_never_returns_is_named_at_its_deadline(tmp_path, tokenizer, generator):
    path = tmp_path / "slow.py"
    path.write_text(textwrap.dedent(SLOW))
    module = load_module(str(path), purpose="test")
    ex = runner(module, tokenizer, generator, step_timeout_s=0.2)
    with pytest.raises(EnvironmentStepError, match=r"AgentInstance\.step\(\) of turn 1 did not "
                       r"return within 0\.2 s \(--train\.agent_step_timeout_s\)"):  # fmt: skip
        run(ex, [QUESTION], ["1"])
    skip = runner(
        module, tokenizer, generator, step_timeout_s=0.2, policy=FailurePolicy(on_failure="skip")
    )
    assert run(skip, [QUESTION], ["1"], n=2).metrics["env/skipped"] == 2.0
