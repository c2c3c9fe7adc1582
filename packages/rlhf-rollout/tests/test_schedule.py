"""The schedules' invariants, driven by a runner that records what happens when: which weight
version each batch is sampled with, what a checkpoint would hold, that generation overlaps
training, and that a failing producer stops the run instead of hanging it."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from rlhf.agents import Trajectory
from rlhf.rollout.schedule import Rollout, run_asynchronous, run_synchronous


class Recorder:
    """A `StepRunner` whose engines are one integer (the weight version they serve)."""

    def __init__(self, *, gen_s: float = 0.01, learn_s: float = 0.02, fail_at: int = -1) -> None:
        self.version = 0
        self.gen_s, self.learn_s, self.fail_at = gen_s, learn_s, fail_at
        self.sampled: dict[int, tuple[int, int]] = {}  # batch → (version at start, at end)
        self.trained: list[int] = []
        self.saved: dict[int, list[int]] = {}  # step → batches in the checkpoint's queue
        self.events: list[tuple[str, int]] = []

    async def generate(self, step: int) -> Rollout:
        self.events.append(("gen_start", step))
        first = self.version
        await asyncio.sleep(self.gen_s)
        if step == self.fail_at:
            raise ValueError(f"reward function failed on batch {step}")
        self.sampled[step] = (first, self.version)
        self.events.append(("gen_end", step))
        trajectory = Trajectory(
            token_ids=(1, 2),
            action_mask=(0, 1),
            rollout_logprobs=(0.0, -0.5),
            prompt_length=1,
            reward=float(step),
            turn_rewards=(float(step),),
            score=float(step),
            truncated=False,
            finish_reason="stop",
            weight_version=first,
        )
        return Rollout(step, [trajectory], {}, {"drawn": step + 1})

    def learn(self, rollout: Rollout) -> dict:
        self.events.append(("learn_start", rollout.step))
        time.sleep(self.learn_s)
        self.trained.append(rollout.step)
        self.events.append(("learn_end", rollout.step))
        return {}

    def sync(self, version: int, *, pause: bool) -> dict:
        self.version = version
        self.events.append(("sync", version))
        return {}

    def saves_at(self, step: int) -> bool:
        return step % 2 == 1

    async def finish(self, step: int, metrics: dict, queue: list[Rollout]) -> None:
        assert len(queue) <= 3
        if self.saves_at(step):
            self.saved[step] = [r.step for r in queue]


@pytest.mark.parametrize("q", [1, 2, 3])
def test_batch_j_is_sampled_with_the_weights_of_step_j_minus_q(q) -> None:
    rec = Recorder()
    asyncio.run(
        run_asynchronous(rec, start=0, end=8, queue=[], queue_size=q, partial_rollouts=False)
    )
    assert rec.trained == list(range(8))
    assert rec.sampled == {j: (max(0, j - q), max(0, j - q)) for j in range(8)}
    # A checkpoint after step s holds the batches already sampled for steps s+1 … s+q.
    assert rec.saved == {s: list(range(s + 1, min(8, s + 1 + q))) for s in (1, 3, 5, 7)}


def test_generation_overlaps_training() -> None:
    rec = Recorder(gen_s=0.05, learn_s=0.1)
    asyncio.run(
        run_asynchronous(rec, start=0, end=4, queue=[], queue_size=1, partial_rollouts=False)
    )
    at = {e: i for i, e in enumerate(rec.events)}
    for j in range(1, 4):  # batch j is sampled while step j-1 trains
        assert at[("gen_start", j)] < at[("learn_end", j - 1)]
        assert at[("gen_end", j)] < at[("sync", j)]  # and finishes on the old weights


def test_the_synchronous_schedule_samples_with_the_newest_weights() -> None:
    rec = Recorder()
    asyncio.run(run_synchronous(rec, start=0, end=4, queue=[]))
    assert rec.sampled == {j: (j, j) for j in range(4)}
    kinds = [kind for kind, _ in rec.events]
    assert kinds == ["gen_start", "gen_end", "learn_start", "learn_end", "sync"] * 4


def test_partial_rollouts_sync_while_a_batch_is_in_flight() -> None:
    rec = Recorder(gen_s=0.3, learn_s=0.01)
    asyncio.run(
        run_asynchronous(rec, start=0, end=4, queue=[], queue_size=1, partial_rollouts=True)
    )
    assert rec.trained == [0, 1, 2, 3]
    # Syncs no longer wait: some batch started on one version and finished on a newer one,
    # and no batch started before the version j - 1 it is bounded by.
    assert any(end > start for start, end in rec.sampled.values()), rec.sampled
    assert all(start >= j - 1 for j, (start, _) in rec.sampled.items())
    # Checkpoints still hold complete batches: the queue was drained before saving.
    assert rec.saved[1] == [2] and rec.saved[3] == []


def test_a_resumed_run_trains_the_restored_batches_first() -> None:
    rec = Recorder()
    rec.version = 4  # the checkpoint's weights were loaded into the engines
    restored = [
        Rollout(4, [], {}, {"drawn": 5}),
        Rollout(5, [], {}, {"drawn": 6}),
    ]
    asyncio.run(
        run_asynchronous(rec, start=4, end=8, queue=restored, queue_size=2, partial_rollouts=False)
    )
    assert rec.trained == [4, 5, 6, 7]
    # Only batches 6 and 7 were sampled, with the weights of steps 4 and 5 as in the run
    # that was not interrupted.
    assert rec.sampled == {6: (4, 4), 7: (5, 5)}


def test_a_failing_producer_stops_the_run_with_its_error() -> None:
    rec = Recorder(fail_at=2)
    with pytest.raises(ValueError, match="reward function failed on batch 2"):
        asyncio.run(
            run_asynchronous(rec, start=0, end=6, queue=[], queue_size=1, partial_rollouts=False)
        )
    assert rec.trained == [0, 1]


def test_rollouts_round_trip_through_checkpoint_state() -> None:
    import json

    rec = Recorder()
    rollout = dataclasses.replace(asyncio.run(rec.generate(3)), sources=["math"])
    again = Rollout.from_state(json.loads(json.dumps(rollout.to_state())))
    assert again == rollout
    # A checkpoint written before rollouts kept their sources reads back without them.
    older = {k: v for k, v in rollout.to_state().items() if k != "sources"}
    assert Rollout.from_state(older).sources == []
