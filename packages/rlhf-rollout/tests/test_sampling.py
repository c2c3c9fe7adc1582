"""`rlhf.rollout.sampling`: a step's draws, complete groups, dynamic filtering's refill and its
limit, the step's digests and seeds, and evaluation's pass@k — driven by an executor whose
scores are a table (each prompt text's scores, in sample order), so every expected number
follows from the table by hand."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from rlhf.agents import ExecutorResult, Trajectory, request_seed
from rlhf.rollout.sampling import (
    EVALUATION,
    MAX_DRAWS,
    TRAINING,
    EmptyStepError,
    evaluate,
    sample_step,
    samples_digest,
    staleness,
)


@dataclass(frozen=True)
class Prompt:
    text: str
    label: Any = None
    source_name: str = ""


class Prompts:
    """A `PromptSource` over a list, in order, its state the number drawn; prompt ``t``
    comes from source ``t.upper()``."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts, self.drawn = list(texts), 0

    def next(self, n: int) -> list[Prompt]:
        texts = [self.texts[(self.drawn + i) % len(self.texts)] for i in range(n)]
        out = [Prompt(t, source_name=t.upper()) for t in texts]
        self.drawn += n
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn}


class TableExecutor:
    """An `rlhf.agents.Executor` whose samples of prompt ``text`` score ``table[text]`` (fewer
    scores than samples: the rest were dropped, as a reward's skip policy drops them)."""

    def __init__(self, table: dict[str, Sequence[float]], *, version: int = 0) -> None:
        self.table, self.version = table, version
        self.calls: list[tuple[list[str], int | None]] = []

    async def run(
        self,
        *,
        prompts: Sequence[str],
        labels: Sequence[Any],
        n_samples_per_prompt: int = 1,
        prompt_indices: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> ExecutorResult:
        self.calls.append((list(prompts), seed))
        out = []
        for p, text in enumerate(prompts):
            for s, score in enumerate(self.table[text][:n_samples_per_prompt]):
                out.append(
                    Trajectory(
                        token_ids=(len(text), p, s),
                        action_mask=(0, 1, 1),
                        rollout_logprobs=(0.0, -0.5, -0.25),
                        prompt_length=1,
                        reward=score,
                        turn_rewards=(score,),
                        score=score,
                        truncated=False,
                        finish_reason="stop",
                        prompt_index=p,
                        sample_index=s,
                        weight_version=self.version,
                    )
                )
        skipped = sum(n_samples_per_prompt - len(self.table[t]) for t in prompts)
        return ExecutorResult(out, {"reward/failed": float(skipped), "other/x": 1.0})


def _middle(scores: Sequence[Sequence[float]]) -> list[bool]:
    """Dynamic filtering's rule with range (0, 1): keep groups whose mean is strictly inside."""
    return [0 < sum(g) / len(g) < 1 for g in scores]


def test_one_draw_keeps_complete_groups_and_reports_the_step() -> None:
    table = {"a": [1.0, 0.0], "b": [1.0], "c": [0.0, 0.0]}  # b lost a sample
    executor, prompts = TableExecutor(table), Prompts(["a", "b", "c"])
    rollout = asyncio.run(
        sample_step(3, batch_size=3, n_samples_per_prompt=2, prompts=prompts, executor=executor)
    )
    assert [(t.token_ids[0], t.score) for t in rollout.trajectories] == [
        (1, 1.0), (1, 0.0), (1, 0.0), (1, 0.0)
    ]  # fmt: skip
    assert [t.prompt_index for t in rollout.trajectories] == [0, 0, 2, 2]
    assert rollout.sources == ["A", "A", "C", "C"]
    m = rollout.metrics
    assert m["rollout/dropped_groups"] == 0.0
    assert m["data/prompts_crc32"] == zlib.crc32(b"a\x00b\x00c")
    assert m["rollout/samples_crc32"] == samples_digest(rollout.trajectories)
    assert m["reward/failed"] == 1.0 and "other/x" not in m
    assert rollout.step == 3 and rollout.sampler_state == {"drawn": 3}
    assert len(executor.calls) == 1 and executor.calls[0][1] is None


def test_dynamic_filtering_draws_again_for_the_dropped_groups() -> None:
    # Draw 1: a (kept), z (all 0: dropped), o (all 1: dropped); draw 2 asks for 2 more:
    # m (kept), z (dropped); draw 3 asks for 1: a (kept) — the batch of 3 is full.
    table = {"a": [1.0, 0.0], "z": [0.0, 0.0], "o": [1.0, 1.0], "m": [0.0, 1.0]}
    executor, prompts = TableExecutor(table), Prompts(["a", "z", "o", "m", "z", "a", "o"])
    rollout = asyncio.run(
        sample_step(
            0, batch_size=3, n_samples_per_prompt=2, prompts=prompts, executor=executor,
            keep_groups=_middle, seed=11,
        )
    )  # fmt: skip
    assert [c[0] for c in executor.calls] == [["a", "z", "o"], ["m", "z"], ["a"]]
    assert [c[1] for c in executor.calls] == [request_seed(11, TRAINING, 0, a) for a in range(3)]
    assert [t.score for t in rollout.trajectories] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    # Each kept sample's source is its own prompt's, across draws.
    assert rollout.sources == ["A", "A", "M", "M", "A", "A"]
    assert rollout.metrics["rollout/dropped_groups"] == 3.0
    crc = zlib.crc32(b"a\x00z\x00o")
    crc = zlib.crc32(b"m\x00z", crc)
    assert rollout.metrics["data/prompts_crc32"] == zlib.crc32(b"a", crc)
    assert rollout.sampler_state == {"drawn": 6}


def test_a_step_with_nothing_left_says_why_after_the_last_draw() -> None:
    executor = TableExecutor({"z": [0.0, 0.0], "h": [1.0]})
    with pytest.raises(EmptyStepError) as caught:
        asyncio.run(
            sample_step(
                4, batch_size=2, n_samples_per_prompt=2, prompts=Prompts(["z", "h"]),
                executor=executor, keep_groups=_middle,
            )
        )  # fmt: skip
    assert len(executor.calls) == MAX_DRAWS
    message = str(caught.value)
    assert message.startswith("step 5: no sample is left to train on: ")
    # Each draw: z's group filtered, h's group incomplete (one of its two samples failed).
    assert f"{MAX_DRAWS} samples' rewards failed" in message
    assert f"{MAX_DRAWS} prompt groups lost samples" in message
    assert f"dynamic filtering dropped {MAX_DRAWS} prompt groups" in message


def test_staleness_and_evaluation() -> None:
    trajectories = asyncio.run(
        sample_step(
            0, batch_size=1, n_samples_per_prompt=2, prompts=Prompts(["a"]),
            executor=TableExecutor({"a": [1.0, 0.0]}, version=2),
        )
    ).trajectories  # fmt: skip
    assert staleness(5, trajectories) == {
        "rollout/staleness_mean": 3.0,
        "rollout/staleness_max": 3.0,
    }
    executor = TableExecutor({"a": [1.0, 0.5, 0.0], "b": [0.0, 0.0, 0.0], "c": [1.0]})
    sources = {"x": [Prompt("a"), Prompt("b")], "y": [Prompt("c")]}
    out = asyncio.run(evaluate(executor, sources, n_samples=3, solved_threshold=1.0, seed=5))
    assert out == {
        "eval/x/pass@1": (1 / 3 + 0) / 2,
        "eval/x/pass@3": 1 / 2,
        "eval/x/score_mean": (1.5 / 3 + 0) / 2,
        "eval/y/pass@1": 1.0,  # the samples that failed count for nothing, not as unsolved
        "eval/y/pass@3": 1.0,
        "eval/y/score_mean": 1.0,
    }
    assert [c[1] for c in executor.calls] == [request_seed(5, EVALUATION, i) for i in (0, 1)]
