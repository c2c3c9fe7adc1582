"""When generation, training and weight syncs happen: the synchronous schedule and the
asynchronous one with a bounded queue of rollouts.

Versions: the engines start at weight version ``start`` (0, or the step a run resumed at);
training step ``s`` turns version ``s`` into ``s + 1``, which the sync after it loads. A rollout's
staleness at step ``s`` is ``s`` minus the version it was sampled with.

Asynchronous schedule with queue size ``q``: batch ``j`` starts generating once the engines
hold version ``j - q`` or newer, so it is sampled while steps ``j - q … j - 1`` train. Without
partial rollouts a sync waits until every batch that must be sampled with older weights is
complete, so batch ``j`` is sampled with exactly version ``max(0, j - q)`` (staleness
``min(j, q)``) and a run is as reproducible as a synchronous one. With partial rollouts a sync
does not wait: the engines are paused, loaded and resumed, and requests in flight finish on the
new weights (a sample's version is then the oldest one that produced any of its tokens, so
staleness is never under-reported).

A checkpoint holds the batches already sampled for later steps (``queue``), so a resumed run
trains on the same samples as an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rlhf.agents import Trajectory

_TUPLE_FIELDS = ("token_ids", "action_mask", "rollout_logprobs", "turn_rewards", "turn_ends")


@dataclasses.dataclass
class Rollout:
    """The samples one RL step trains on.

    Attributes:
        step: The step that trains on them (0-based).
        trajectories: `rlhf.agents.Trajectory` objects, complete prompt groups in order.
        metrics: Generation metrics (executor metrics, dropped groups, prompt digest,
            ``time/generation_s``).
        sampler_state: The prompt sampler's state right after this batch's prompts were
            drawn: a resumed run draws on from the newest batch it restored.
        sources: The data source of each trajectory's prompt (`Prompt.source_name`), in
            trajectory order: what routes a sample to its teacher when several teachers
            distil by data source (empty in a rollout made without them).
    """

    step: int
    trajectories: list[Trajectory]
    metrics: dict[str, float]
    sampler_state: dict[str, object]
    sources: list[str] = dataclasses.field(default_factory=list)

    def to_state(self) -> dict[str, object]:
        """Plain JSON-able data (for checkpoints)."""
        return {
            "step": self.step,
            "trajectories": [dataclasses.asdict(t) for t in self.trajectories],
            "metrics": dict(self.metrics),
            "sampler_state": dict(self.sampler_state),
            "sources": list(self.sources),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Rollout:
        """A rollout from `to_state`'s data (read back from a checkpoint, so unchecked)."""
        from rlhf.agents import Trajectory

        def fields(t: dict[str, Any]) -> dict[str, Any]:  # to_state's asdict, tuples back
            return {k: tuple(v) if k in _TUPLE_FIELDS else v for k, v in t.items()}

        trajectories = [Trajectory(**fields(t)) for t in state["trajectories"]]
        return cls(
            step=int(state["step"]),
            trajectories=trajectories,
            metrics=dict(state["metrics"]),
            sampler_state=dict(state["sampler_state"]),
            sources=[str(s) for s in state.get("sources", [])],
        )


class StepRunner(Protocol):
    """What a schedule drives (the RL driver implements it)."""

    def generate(self, step: int) -> Awaitable[Rollout]:
        """Sample the batch of ``step`` with the weights the engines hold now."""
        ...

    def learn(self, rollout: Rollout) -> dict[str, float]:
        """Train step ``rollout.step`` on it (blocking); returns the step's metrics."""
        ...

    def sync(self, version: int, *, pause: bool) -> dict[str, float]:
        """Load the actor's weights into every engine as ``version`` (blocking); with
        ``pause``, the engines are paused around the load (requests in flight kept)."""
        ...

    def saves_at(self, step: int) -> bool:
        """Whether a checkpoint follows ``step``."""
        ...

    def finish(self, step: int, metrics: dict[str, float], queue: list[Rollout]) -> Awaitable[None]:
        """Log, evaluate and checkpoint after ``step``; ``queue`` holds the rollouts already
        sampled for later steps (complete whenever `saves_at` says so)."""
        ...


async def run_synchronous(
    runner: StepRunner, *, start: int, end: int, queue: list[Rollout]
) -> None:
    """Generation and training alternate: every batch is sampled with the newest weights
    (``queue``: rollouts restored from an asynchronous run's checkpoint, trained first)."""
    pending = {r.step: r for r in queue}
    for step in range(start, end):
        rollout = pending.pop(step, None) or await runner.generate(step)
        metrics = await asyncio.to_thread(runner.learn, rollout)
        tick = time.perf_counter()
        metrics.update(await asyncio.to_thread(runner.sync, step + 1, pause=False))
        metrics["time/sync_s"] = time.perf_counter() - tick
        await runner.finish(step, metrics, [pending[j] for j in sorted(pending)])


async def run_asynchronous(
    runner: StepRunner,
    *,
    start: int,
    end: int,
    queue: list[Rollout],
    queue_size: int,
    partial_rollouts: bool,
) -> None:
    """Generation of later batches overlaps training (see the module docstring).

    Args:
        runner: The driver.
        start: First step to train (the engines hold version ``start``).
        end: Steps of the run.
        queue: Rollouts restored from a checkpoint, for steps ``start, start + 1, …``.
        queue_size: Most batches sampled ahead of training (the staleness bound).
        partial_rollouts: Sync without waiting for batches in flight (pause, load, resume).
    """
    if queue_size < 1:
        raise ValueError(f"queue_size must be >= 1, got {queue_size}")
    ready: dict[int, Rollout] = {r.step: r for r in queue}
    first_to_sample = start + len(ready)
    if sorted(ready) != list(range(start, first_to_sample)):
        raise ValueError(f"restored rollouts {sorted(ready)} are not steps {start}, {start + 1}, …")
    done = {j: asyncio.Event() for j in range(start, end)}
    for j in ready:
        done[j].set()
    synced = start
    version_changed = asyncio.Condition()

    async def produce() -> None:
        for j in range(first_to_sample, end):
            async with version_changed:
                await version_changed.wait_for(lambda j=j: synced >= j - queue_size)
            ready[j] = await runner.generate(j)
            done[j].set()

    producer = asyncio.create_task(produce(), name="rlhf-rollout-producer")

    async def complete(j: int) -> None:
        if done[j].is_set():
            return
        waiter = asyncio.ensure_future(done[j].wait())
        await asyncio.wait({waiter, producer}, return_when=asyncio.FIRST_COMPLETED)
        if not done[j].is_set():
            waiter.cancel()
            producer.result()  # the producer's error
            raise RuntimeError(f"the rollout producer stopped before batch {j}")

    try:
        for step in range(start, end):
            tick = time.perf_counter()
            await complete(step)
            waited = time.perf_counter() - tick
            metrics = await asyncio.to_thread(runner.learn, ready.pop(step))
            ahead = range(step + 1, min(end, step + 1 + queue_size))
            tick = time.perf_counter()
            if not partial_rollouts:  # batches due to older weights finish on them
                for j in ahead:
                    await complete(j)
            metrics["time/sync_wait_s"] = time.perf_counter() - tick
            tick = time.perf_counter()
            metrics.update(await asyncio.to_thread(runner.sync, step + 1, pause=partial_rollouts))
            metrics["time/sync_s"] = time.perf_counter() - tick
            async with version_changed:
                synced = step + 1
                version_changed.notify_all()
            metrics["time/rollout_wait_s"] = waited
            metrics["rollout/queued"] = float(sum(j in ready for j in ahead))
            if runner.saves_at(step):  # the checkpoint holds the queue, drained of partials
                for j in ahead:
                    await complete(j)
            await runner.finish(step, metrics, [ready[j] for j in ahead if j in ready])
    finally:
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await producer
