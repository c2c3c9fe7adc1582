"""Multi-turn executor: token-in-token-out streams against real environments and a real LM."""

import asyncio
import textwrap

import pytest

from rlhf.agents import (
    EnvironmentFactory,
    EnvironmentStepError,
    Generation,
    MultiTurnExecutor,
    SamplingParams,
    StepResult,
)

QUESTION = "Guess a number between 0 and 9."


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def executor(tokenizer, generator, environments, **kw) -> MultiTurnExecutor:
    defaults = {
        "sampling": SamplingParams(max_new_tokens=6, temperature=1.0),
        "max_len": 256,
        "max_turns": 3,
    }
    return MultiTurnExecutor(
        tokenizer=tokenizer, generator=generator, environments=environments, **{**defaults, **kw}
    )


def run(ex, prompts, labels, n=1):
    return asyncio.run(ex.run(prompts=prompts, labels=labels, n_samples_per_prompt=n))


def env_file(tmp_path, body: str) -> EnvironmentFactory:
    path = tmp_path / "env.py"
    path.write_text(textwrap.dedent(body))
    return EnvironmentFactory.from_file(str(path))


def test_stream_is_the_generations_plus_feedback_and_renders_as_the_chat_template(
    tokenizer, generator, examples
) -> None:
    envs = EnvironmentFactory.from_file(str(examples / "env_guess_number.py"))
    prompt = chat(tokenizer, QUESTION)
    result = run(executor(tokenizer, generator, envs), [prompt, prompt], [4, 7], n=2)
    assert len(result.trajectories) == 4
    for t in result.trajectories:
        # Each generation was asked for with exactly the stream so far (no re-tokenization) and
        # its tokens appear verbatim; everything else is prompt or feedback with mask 0.
        calls = [
            (p, g)
            for p, g in generator.calls
            if list(t.token_ids[: len(p)]) == p
            and tuple(t.token_ids[len(p) : len(p) + len(g.token_ids)]) == g.token_ids
        ]
        calls.sort(key=lambda c: len(c[0]))
        assert len(calls) == len(t.turn_rewards)
        expected_mask = [0] * len(t.token_ids)
        for p, g in calls:
            for i in range(len(p), len(p) + len(g.token_ids)):
                expected_mask[i] = 1
            assert tuple(t.rollout_logprobs[len(p) : len(p) + len(g.token_ids)]) == g.logprobs
        assert list(t.action_mask) == expected_mask
        assert all(
            lp == 0.0 for lp, m in zip(t.rollout_logprobs, t.action_mask, strict=True) if not m
        )

        # The stream, decoded, is what the chat template renders for the same conversation.
        messages = [{"role": "user", "content": QUESTION}]
        for i, (_, g) in enumerate(calls):
            text = tokenizer.decode(list(g.token_ids), skip_special_tokens=True)
            messages.append({"role": "assistant", "content": text})
            if i + 1 < len(calls):
                feedback_start = len(calls[i][0]) + len(g.token_ids)
                feedback_ids = t.token_ids[feedback_start : len(calls[i + 1][0])]
                feedback = tokenizer.decode(list(feedback_ids), skip_special_tokens=False)
                hint = (
                    "Too low."
                    if "Too low." in feedback
                    else "Too high."
                    if "Too high." in feedback
                    else "Answer with a number."
                )
                messages.append({"role": "user", "content": hint})
        _, last = calls[-1]
        rendered = tokenizer.apply_chat_template(
            messages[:-1], tokenize=False, add_generation_prompt=True
        )
        stream = tokenizer.decode(list(t.token_ids), skip_special_tokens=False)
        assert stream == rendered + tokenizer.decode(
            list(last.token_ids), skip_special_tokens=False
        )
        assert t.reward == sum(t.turn_rewards)
        assert t.metrics["env/turns"] == len(t.turn_rewards)


def test_max_turns_truncates_and_turn_rewards_are_kept(tmp_path, tokenizer, generator) -> None:
    envs = env_file(
        tmp_path,
        """
        from rlhf.agents import StepResult
        class Environment:
            def reset(self, prompt, label):
                self.turn = 0
            def step(self, action_text):
                self.turn += 1
                return StepResult(feedback=f"turn {self.turn}", reward=0.5, metrics={"turn": self.turn})
        """,
    )
    result = run(executor(tokenizer, generator, envs, max_turns=3), [chat(tokenizer, "go")], [None])
    (t,) = result.trajectories
    assert t.truncated
    assert t.turn_rewards == (0.5, 0.5, 0.5)
    assert t.reward == 1.5
    assert t.score == 1.5
    assert t.metrics["turn"] == 3
    assert result.metrics["rollout/truncated_frac"] == 1.0
    # Per-episode metrics are aggregated for the run's log.
    assert result.metrics["env/turn_mean"] == 3.0
    assert result.metrics["env/turns_mean"] == 3.0 and result.metrics["env/turns_max"] == 3.0


def test_environment_that_never_ends_is_cut_at_max_len(tmp_path, tokenizer, generator) -> None:
    envs = env_file(
        tmp_path,
        """
        class Environment:
            def reset(self, prompt, label):
                pass
            def step(self, action_text):
                return {"feedback": "keep going " * 3, "reward": 0.0, "done": False}
        """,
    )
    prompt = chat(tokenizer, "go")
    budget = len(tokenizer.encode(prompt, add_special_tokens=False)) + 30
    result = run(
        executor(tokenizer, generator, envs, max_turns=50, max_len=budget), [prompt], [None]
    )
    (t,) = result.trajectories
    assert t.truncated
    assert len(t.token_ids) <= budget
    assert len(t.turn_rewards) < 50


def test_done_ends_the_episode_and_sampling_overrides_apply(tmp_path, tokenizer, generator) -> None:
    envs = env_file(
        tmp_path,
        """
        from rlhf.agents import StepResult
        class Environment:
            def reset(self, prompt, label):
                self.n = 0
            def step(self, action_text):
                self.n += 1
                if self.n == 2:
                    return StepResult(reward=1.0, done=True, score=0.25)
                return StepResult(feedback="shorter please", sampling={"max_new_tokens": 2})
        """,
    )
    result = run(executor(tokenizer, generator, envs, max_turns=5), [chat(tokenizer, "go")], [None])
    (t,) = result.trajectories
    assert not t.truncated
    assert t.turn_rewards == (0.0, 1.0)
    assert t.score == 0.25
    assert len(generator.calls[-1][1].token_ids) <= 2


def test_async_environment_with_async_create(tokenizer, generator, examples) -> None:
    envs = EnvironmentFactory.from_file(
        str(examples / "env_calculator.py"), env_kwargs={"tool_limit": 2}
    )
    result = run(
        executor(tokenizer, generator, envs), [chat(tokenizer, "What is 6 times 7?")], ["42"], n=2
    )
    assert len(result.trajectories) == 2
    for t in result.trajectories:
        assert 1 <= len(t.turn_rewards) <= 3
        assert "tool_calls" in t.metrics
    calls = [t.metrics["tool_calls"] for t in result.trajectories]
    assert result.metrics["env/tool_calls_mean"] == pytest.approx(sum(calls) / 2)
    turns = [len(t.turn_rewards) for t in result.trajectories]
    assert result.metrics["env/turns_max"] == max(turns)


@pytest.mark.parametrize(
    ("step_body", "message"),
    [
        (
            "raise RuntimeError('sandbox died')",
            r"step\(\) on turn 0 raised RuntimeError\('sandbox died'\)",
        ),
        (
            "return 'done'",
            r"turn 0: step\(\) must return a StepResult or a dict of its fields, got str",
        ),
        (
            "return {'reward': 1.0, 'finished': True}",
            r"step\(\) returned unknown keys \['finished'\]",
        ),
        (
            "return StepResult(reward=float('nan'))",
            r"StepResult.reward must be a finite number, got nan",
        ),
        ("return StepResult(done='yes')", r"StepResult.done must be bool, got 'yes'"),
    ],
)
def test_misbehaving_environments_name_the_file_prompt_and_turn(
    tmp_path, tokenizer, generator, step_body, message
) -> None:
    envs = env_file(
        tmp_path,
        f"""
        from rlhf.agents import StepResult
        class Environment:
            def reset(self, prompt, label):
                pass
            def step(self, action_text):
                {step_body}
        """,
    )
    with pytest.raises(
        EnvironmentStepError, match=r"environment Environment in .*env\.py \(prompt 0, sample 0\)"
    ):
        run(executor(tokenizer, generator, envs), [chat(tokenizer, "go")], [None])
    with pytest.raises(EnvironmentStepError, match=message):
        run(executor(tokenizer, generator, envs), [chat(tokenizer, "go")], [None])


def test_a_step_that_never_returns_fails_at_its_deadline(tmp_path, tokenizer, generator) -> None:
    """A synchronous step() runs on a thread of its own, so the deadline can fire while it
    blocks (called on the event loop, it would block every episode, forever)."""
    envs = env_file(
        tmp_path,
        """
        import threading
        class Environment:
            def reset(self, prompt, label):
                pass
            def step(self, action_text):
                threading.Event().wait()  # never returns
        """,
    )
    hung = executor(tokenizer, generator, envs, step_timeout_s=0.3)
    with pytest.raises(
        EnvironmentStepError,
        match=r"\(prompt 0, sample 0\): step\(\) on turn 0 did not return within 0.3 s",
    ):
        run(hung, [chat(tokenizer, "go")], [None])
    with pytest.raises(ValueError, match="step_timeout_s must be > 0"):
        executor(tokenizer, generator, envs, step_timeout_s=0)


def test_bad_environment_classes_are_refused_clearly(tmp_path) -> None:
    with pytest.raises(
        TypeError, match=r"__init__ cannot be a coroutine; do async set-up in an `async def create"
    ):
        env_file(
            tmp_path,
            "class Environment:\n    async def __init__(self):\n        pass\n    def reset(self, p, l):\n        pass\n    def step(self, a):\n        pass\n",
        )
    with pytest.raises(TypeError, match=r"must define step\(\)"):
        env_file(tmp_path, "class Environment:\n    def reset(self, p, l):\n        pass\n")
    with pytest.raises(AttributeError, match=r"defines no 'Environment'"):
        env_file(tmp_path, "class Env:\n    pass\n")
    with pytest.raises(FileNotFoundError, match="environment file"):
        EnvironmentFactory.from_file(str(tmp_path / "missing.py"))


def test_step_result_defaults() -> None:
    assert StepResult() == StepResult(feedback="", reward=0.0, done=False)


class ScriptedGenerator:
    """A Generator that replays fixed token sequences, ended by the length limit (no EOS)."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = list(replies)

    async def generate(self, prompt_token_ids, sampling):
        ids = self.replies.pop(0)[: sampling.max_new_tokens]
        return Generation(token_ids=tuple(ids), logprobs=(-1.0,) * len(ids), finish_reason="length")


def test_cut_turns_are_closed_with_the_end_of_turn_token(tmp_path, tokenizer) -> None:
    envs = env_file(
        tmp_path,
        """
        class Environment:
            def reset(self, prompt, label):
                self.n = 0
            def step(self, action_text):
                self.n += 1
                return {"feedback": "again", "done": self.n == 3}
        """,
    )
    # Replies whose text ends in "<": a text-level match would close them with "|im_end|>".
    replies = [tokenizer.encode(t, add_special_tokens=False) for t in ("x <", "y <|", "z")]
    ex = MultiTurnExecutor(
        tokenizer=tokenizer,
        generator=ScriptedGenerator(replies),
        environments=envs,
        sampling=SamplingParams(max_new_tokens=8),
        max_len=256,
        max_turns=5,
    )
    (t,) = run(ex, [chat(tokenizer, "go")], [None]).trajectories
    eos = tokenizer.eos_token_id
    # One end-of-turn token for the prompt's user turn, one closing each of the two cut turns
    # that got feedback, one per feedback turn.
    assert list(t.token_ids).count(eos) == 1 + 2 + 2
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "x <"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "y <|"},
        {"role": "user", "content": "again"},
    ]
    expected_prefix = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(list(t.token_ids)) == expected_prefix + "z"


def test_environment_metrics_and_sampling_overrides_are_validated(
    tmp_path, tokenizer, generator
) -> None:
    bad_metrics = env_file(
        tmp_path,
        "class Environment:\n    def reset(self, p, l):\n        pass\n    def step(self, a):\n        return {'metrics': {'note': 'n/a'}}\n",
    )
    with pytest.raises(
        EnvironmentStepError,
        match=r"turn 0: StepResult.metrics\['note'\] must be a finite number, got 'n/a'",
    ):
        run(executor(tokenizer, generator, bad_metrics), [chat(tokenizer, "go")], [None])
    bad_sampling = env_file(
        tmp_path,
        "class Environment:\n    def reset(self, p, l):\n        pass\n    def step(self, a):\n        return {'feedback': 'x', 'sampling': {'max_tokens': 2}}\n",
    )
    with pytest.raises(
        EnvironmentStepError,
        match=r"turn 0: bad sampling override: unknown sampling parameter\(s\) \['max_tokens'\]",
    ):
        run(executor(tokenizer, generator, bad_sampling), [chat(tokenizer, "go")], [None])


def test_numpy_and_torch_scalars_are_numbers(tmp_path, tokenizer, generator) -> None:
    envs = env_file(
        tmp_path,
        """
        import numpy as np
        import torch
        class Environment:
            def reset(self, prompt, label):
                pass
            def step(self, action_text):
                return {"reward": np.float32(0.5), "score": torch.tensor(1.0), "done": True, "metrics": {"m": np.int64(3)}}
        """,
    )
    (t,) = run(executor(tokenizer, generator, envs), [chat(tokenizer, "go")], [None]).trajectories
    assert t.turn_rewards == (0.5,)
    assert t.score == 1.0
    assert t.metrics["m"] == 3.0


def test_async_create_is_what_builds_the_instance(tmp_path, tokenizer, generator) -> None:
    envs = env_file(
        tmp_path,
        """
        import asyncio
        class Environment:
            def __init__(self, resource):
                self.resource = resource
            @classmethod
            async def create(cls, **kwargs):
                await asyncio.sleep(0)
                return cls(resource="opened-by-create")
            def reset(self, prompt, label):
                pass
            def step(self, action_text):
                return {"done": True, "metrics": {"created": float(self.resource == "opened-by-create")}}
        """,
    )
    (t,) = run(executor(tokenizer, generator, envs), [chat(tokenizer, "go")], [None]).trajectories
    assert t.metrics["created"] == 1.0


def test_turn_ends_mark_each_turns_last_action_token(tmp_path, tokenizer) -> None:
    envs = env_file(
        tmp_path,
        """
        class Environment:
            def reset(self, prompt, label):
                self.n = 0
            def step(self, action_text):
                self.n += 1
                return {"feedback": "more", "reward": float(self.n), "done": self.n == 3}
        """,
    )
    replies = [tokenizer.encode(t, add_special_tokens=False) for t in ("a b", "c", "d e f")]
    ex = MultiTurnExecutor(
        tokenizer=tokenizer,
        generator=ScriptedGenerator([list(r) for r in replies]),
        environments=envs,
        sampling=SamplingParams(max_new_tokens=8),
        max_len=256,
        max_turns=5,
    )
    (t,) = run(ex, [chat(tokenizer, "go")], [None]).trajectories
    # The last index of each run of action tokens, read off the mask.
    mask = t.action_mask
    runs = [i for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
    assert t.turn_ends == tuple(runs) and len(runs) == 3
    assert [t.token_ids[i] for i in t.turn_ends] == [r[-1] for r in replies]
    assert t.turn_rewards == (1.0, 2.0, 3.0)


def test_turn_ends_must_name_one_action_token_per_turn() -> None:
    from rlhf.agents import Trajectory

    def make(turn_ends):
        return Trajectory(
            token_ids=(1, 2, 3, 4), action_mask=(0, 1, 0, 1), rollout_logprobs=(0.0,) * 4,
            prompt_length=1, reward=1.0, turn_rewards=(0.5, 0.5), score=1.0, truncated=False,
            finish_reason="stop", turn_ends=turn_ends,
        )  # fmt: skip

    assert make((1, 3)).turn_ends == (1, 3)
    for bad in ((1,), (2, 3), (1, 4)):
        with pytest.raises(ValueError, match="turn_ends"):
            make(bad)


FLAKY_ENV = """
class Environment:
    def reset(self, prompt, label):
        self.label, self.turn = label, 0
        if label == "broken at reset":
            raise RuntimeError("no such task")
    def step(self, action_text):
        self.turn += 1
        if self.label == "broken at step 2" and self.turn == 2:
            raise RuntimeError("the sandbox crashed")
        return {"feedback": "again", "reward": 0.25, "done": self.turn == 3}
"""


@pytest.mark.parametrize("policy", ["raise", "skip", "fallback"])
def test_failed_episodes_follow_the_failure_policy(tmp_path, tokenizer, policy) -> None:
    from rlhf.agents import EnvironmentStepError, FailurePolicy

    replies = [tokenizer.encode(t, add_special_tokens=False) for t in ("a", "b", "c")] * 3
    ex = MultiTurnExecutor(
        tokenizer=tokenizer,
        generator=ScriptedGenerator([list(r) for r in replies]),
        environments=env_file(tmp_path, FLAKY_ENV),
        sampling=SamplingParams(max_new_tokens=4),
        max_len=256,
        max_turns=3,
        policy=FailurePolicy(on_failure=policy, fallback_reward=-1.0),
    )
    prompts = [chat(tokenizer, "go")] * 3
    labels = ["fine", "broken at step 2", "broken at reset"]
    if policy == "raise":
        with pytest.raises(EnvironmentStepError, match="sandbox crashed|no such task") as caught:
            run(ex, prompts, labels)
        # The environment file's own traceback lines come with the message.
        assert "    raise RuntimeError(" in str(caught.value)
        return
    result = run(ex, prompts, labels)
    by_prompt = {t.prompt_index: t for t in result.trajectories}
    assert by_prompt[0].reward == 0.75 and not by_prompt[0].truncated  # 3 turns of 0.25
    assert 2 not in by_prompt  # failed before the policy acted: nothing to train on
    m = result.metrics
    assert m["env/failed"] == 2.0
    # The first failure the policy absorbed is kept, so an empty step can say why.
    assert "sandbox crashed" in result.failure or "no such task" in result.failure
    if policy == "skip":
        assert sorted(by_prompt) == [0] and (m["env/skipped"], m["env/fallback"]) == (2.0, 0.0)
        return
    cut = by_prompt[1]  # ended after its second action, whose step() failed
    assert (cut.reward, cut.turn_rewards, cut.truncated) == (-1.0, (-1.0,), True)
    assert sum(cut.action_mask) == 2 and cut.turn_ends == (len(cut.token_ids) - 1,)
    assert (m["env/skipped"], m["env/fallback"]) == (1.0, 1.0)
