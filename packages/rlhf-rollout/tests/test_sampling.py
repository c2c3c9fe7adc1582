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

from rlhf.agents import ExecutorResult, Trajectory, merge_results, request_seed
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
    scores than samples: the rest were dropped, as a reward's skip policy drops them). A call
    over a prompt in ``waits`` first sleeps that many seconds (None: until cancelled; the
    cancelled prompts are recorded)."""

    def __init__(
        self,
        table: dict[str, Sequence[float]],
        *,
        version: int = 0,
        waits: dict[str, float | None] | None = None,
    ) -> None:
        self.table, self.version, self.waits = table, version, waits or {}
        self.calls: list[tuple[list[str], int | None]] = []
        self.cancelled: list[str] = []

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
        for text in prompts:
            if text in self.waits:
                wait = self.waits[text]
                try:
                    await asyncio.sleep(3600 if wait is None else wait)
                except asyncio.CancelledError:
                    self.cancelled.append(text)
                    raise
        indices = list(prompt_indices) if prompt_indices is not None else range(len(prompts))
        out = []
        for p, text in zip(indices, prompts, strict=True):
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


def test_oversampling_keeps_the_first_groups_to_finish_and_cancels_the_rest() -> None:
    # batch 2 × oversample 2.5 → 5 prompts, one call each, all under draw 0's seed. b, c and d
    # answer at once, a after 50 ms and s never: b and c fill the batch, d finished too late
    # to be needed, a and s are cancelled.
    table = {t: [1.0, 0.0] for t in "abcds"}
    table["d"] = [1.0]  # lost a sample: d's group is incomplete, so it is no candidate
    table["c"] = [0.5, 0.5]
    executor = TableExecutor(table, waits={"a": 0.05, "s": None})
    rollout = asyncio.run(
        sample_step(
            1, batch_size=2, n_samples_per_prompt=2, prompts=Prompts(["a", "b", "c", "d", "s", "e"]),
            executor=executor, seed=7, oversample=2.5,
        )
    )  # fmt: skip
    assert sorted(c[0][0] for c in executor.calls) == ["a", "b", "c", "d", "s"]
    assert {c[1] for c in executor.calls} == {request_seed(7, TRAINING, 1, 0)}
    assert sorted(executor.cancelled) == ["a", "s"]
    # The kept groups in draw order, each trajectory naming its prompt's place in the draw.
    assert [(t.prompt_index, t.score) for t in rollout.trajectories] == [
        (1, 1.0), (1, 0.0), (2, 0.5), (2, 0.5)
    ]  # fmt: skip
    assert rollout.sources == ["B", "B", "C", "C"]
    m = rollout.metrics
    assert m["rollout/oversample_cancelled"] == 2.0
    assert m["rollout/oversample_unused"] == 0.0  # d finished, but incomplete
    assert m["reward/failed"] == 1.0  # b's, c's and d's calls merged: d's one lost sample
    assert m["data/prompts_crc32"] == zlib.crc32(b"a\x00b\x00c\x00d\x00s")
    assert rollout.sampler_state == {"drawn": 5}
    # Two that finish together for a batch of one: the first drawn is kept, the other unused.
    rollout = asyncio.run(
        sample_step(
            0, batch_size=1, n_samples_per_prompt=2, prompts=Prompts(["c", "b"]),
            executor=TableExecutor(table), oversample=2.0,
        )
    )  # fmt: skip
    assert [t.score for t in rollout.trajectories] == [0.5, 0.5]
    assert rollout.metrics["rollout/oversample_unused"] == 1.0
    assert rollout.metrics["rollout/oversample_cancelled"] == 0.0


def test_oversampling_draws_again_for_groups_the_filter_drops() -> None:
    # Draw 0 needs 3 → ceil(4.5) = 5 prompts z a o m z, finishing together: the filter keeps
    # a and m (z: all 0, o: all 1, dropped), so the batch of 3 lacks one. Draw 1 needs 1 →
    # 2 prompts, a and (the list starts over) z: a is kept, z dropped.
    table = {"a": [1.0, 0.0], "z": [0.0, 0.0], "o": [1.0, 1.0], "m": [0.0, 1.0]}
    executor = TableExecutor(table)
    rollout = asyncio.run(
        sample_step(
            0, batch_size=3, n_samples_per_prompt=2, prompts=Prompts(["z", "a", "o", "m", "z", "a"]),
            executor=executor, keep_groups=_middle, oversample=1.5,
        )
    )  # fmt: skip
    assert [t.score for t in rollout.trajectories] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert rollout.sources == ["A", "A", "M", "M", "A", "A"]
    assert rollout.metrics["rollout/dropped_groups"] == 4.0
    assert rollout.metrics["rollout/oversample_unused"] == 0.0
    assert rollout.metrics["rollout/oversample_cancelled"] == 0.0
    assert rollout.sampler_state == {"drawn": 7}


def test_a_failed_call_under_oversampling_raises_and_cancels_the_others() -> None:
    # "x" is in no table: its call raises KeyError; "s" waits until cancelled.
    executor = TableExecutor({"s": [1.0, 0.0]}, waits={"s": None})
    with pytest.raises(KeyError, match="x"):
        asyncio.run(
            sample_step(
                0, batch_size=1, n_samples_per_prompt=2, prompts=Prompts(["s", "x"]),
                executor=executor, oversample=2.0,
            )
        )  # fmt: skip
    assert executor.cancelled == ["s"]


def test_oversampling_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="oversample must be at least 1, got 0.5"):
        asyncio.run(
            sample_step(
                0, batch_size=1, n_samples_per_prompt=1, prompts=Prompts(["a"]),
                executor=TableExecutor({"a": [1.0]}), oversample=0.5,
            )
        )  # fmt: skip


def test_merged_results_weigh_means_by_samples() -> None:
    one = ExecutorResult([], {"rollout/samples": 2.0, "x_mean": 1.0, "t_frac": 0.5, "n": 1.0})
    two = ExecutorResult(
        [], {"rollout/samples": 6.0, "x_mean": 3.0, "t_frac": 0.0, "n": 2.0, "k_max": 4.0},
        failure="boom",
    )  # fmt: skip
    merged = merge_results([one, two, ExecutorResult([], {"k_max": 9.0, "k_min": -1.0})])
    assert merged.metrics == {
        "rollout/samples": 8.0,
        "x_mean": (2 * 1.0 + 6 * 3.0) / 8,
        "t_frac": (2 * 0.5) / 8,
        "n": 3.0,
        "k_max": 9.0,
        "k_min": -1.0,
    }
    assert merged.failure == "boom"
