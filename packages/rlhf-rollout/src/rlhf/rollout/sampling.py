"""One RL step's generation and an evaluation, over any `rlhf.agents.Executor`.

- `sample_step`: draw a step's prompts from a `PromptSource`, sample ``n`` per prompt, keep the
  prompt groups that are complete (a reward's ``skip`` policy can drop samples), and, with a
  `GroupFilter` (dynamic filtering: ``rlhf.algos.dynamic_filter``), drop the groups it rejects
  and draw again for the missing ones, at most `MAX_DRAWS` times. With ``oversample`` > 1 a
  draw asks for that many times the prompts it needs, one executor call per prompt, keeps the
  first complete groups to finish (in draw order) and cancels the rest: the step no longer
  waits for its slowest group (the long tail), at the price of samples that depend on timing.
  The result is a `rlhf.rollout.Rollout` with the step's metrics and the source's state after
  the draws.
- `evaluate`: `pass_at` of each evaluation source's prompts, at fixed request seeds.
- `staleness`, `samples_digest`: what a step's samples say about themselves.

Request seeds come from `rlhf.agents.request_seed` under one run seed, in two streams
(`TRAINING`, `EVALUATION`), so a resumed or repeated run samples the same requests.
"""

from __future__ import annotations

import array
import asyncio
import math
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rlhf.agents import Executor, ExecutorResult, Trajectory, merge_results, request_seed
from rlhf.rollout.schedule import Rollout

TRAINING, EVALUATION = 0, 1
"""The two streams of request seeds under one run seed (`sample_step`, `evaluate`)."""

MAX_DRAWS = 4
"""Draws of one step under a `GroupFilter`: the first and three replacement draws at most."""

GroupFilter = Callable[[Sequence[Sequence[float]]], Sequence[bool]]
"""``scores[group][sample]`` of complete prompt groups → whether to keep each group."""


class Prompt(Protocol):
    """A prompt as a `PromptSource` draws it: the text the policy sees, its label and the
    name of the data source it came from (empty: unnamed)."""

    @property
    def text(self) -> str: ...

    @property
    def label(self) -> object: ...

    @property
    def source_name(self) -> str: ...


class PromptSource(Protocol):
    """Where a step's prompts come from, resumable from its state."""

    def next(self, n: int) -> Sequence[Prompt]:
        """The next ``n`` prompts."""
        ...

    def state_dict(self) -> dict[str, object]: ...


class EmptyStepError(RuntimeError):
    """A step has no sample left to train on; the message says why, cause by cause, with the
    option that decides each."""


def empty_step_message(
    step: int, *, dropped_groups: int, incomplete: int, lost: Mapping[str, float], failure: str
) -> str:
    """Why step ``step`` (0-based) has no sample left to train on, cause by cause, each with
    the flag that decides it; ``failure`` is the first failure a policy absorbed."""
    causes = []
    if lost.get("env/skipped"):
        causes.append(
            f"{lost['env/skipped']:.0f} episodes failed and were left out by "
            "--train.agent_failure_policy (skip; or fallback, which has nothing to keep when an "
            "episode fails before the policy's first action, e.g. in reset())"
        )
    if lost.get("reward/failed"):
        causes.append(
            f"{lost['reward/failed']:.0f} samples' rewards failed and were skipped "
            "(--reward.failure_policy skip; fallback gives them --reward.fallback_value)"
        )
    if incomplete:
        causes.append(f"{incomplete} prompt groups lost samples and were dropped whole")
    if dropped_groups:
        causes.append(
            f"dynamic filtering dropped {dropped_groups} prompt groups whose mean score was "
            "outside --algo.dynamic_filtering_range"
        )
    why = "; ".join(causes) or "the executor returned no sample"
    first = f". The first failure: {failure}" if failure else ""
    return f"step {step + 1}: no sample is left to train on: {why}{first}"


def complete_groups(trajectories: Sequence[Trajectory], n: int) -> list[list[Trajectory]]:
    """Trajectories grouped by prompt, in prompt order, keeping only groups with all ``n``
    samples."""
    groups: dict[int, list[Trajectory]] = {}
    for tr in trajectories:
        groups.setdefault(tr.prompt_index, []).append(tr)
    return [g for _, g in sorted(groups.items()) if len(g) == n]


_KEPT_METRICS = ("rollout/truncated", "rollout/prompts_truncated", "reward/", "env/")
"""The executor's metrics of a step's first draw that the step reports."""


@dataclass
class _Draw:
    """What one draw of a step gave: its complete groups that the filter kept (each a
    prompt's samples, in draw order) and what happened to the others."""

    groups: list[list[Trajectory]] = field(default_factory=list)
    result: ExecutorResult = field(default_factory=lambda: ExecutorResult([]))
    incomplete: int = 0
    dropped: int = 0
    unused: int = 0
    """Complete, kept groups that finished after the draw had what it needed."""
    cancelled: int = 0
    """Prompts whose executor call was cancelled unfinished."""


def _kept_groups(
    groups: Sequence[list[Trajectory]], keep_groups: GroupFilter | None, draw: _Draw
) -> list[list[Trajectory]]:
    """The groups ``keep_groups`` keeps (all of them without a filter); counts the others."""
    if keep_groups is None or not groups:
        return list(groups)
    keep = list(keep_groups([[float(tr.score) for tr in g] for g in groups]))
    draw.dropped += len(groups) - sum(keep)
    return [g for g, k in zip(groups, keep, strict=True) if k]


async def _draw_all(
    executor: Executor,
    drawn: Sequence[Prompt],
    *,
    n: int,
    seed: int | None,
    keep_groups: GroupFilter | None,
) -> _Draw:
    """Every drawn prompt's group from one executor call."""
    draw = _Draw()
    draw.result = await executor.run(
        prompts=[p.text for p in drawn],
        labels=[p.label for p in drawn],
        n_samples_per_prompt=n,
        seed=seed,
    )
    groups = complete_groups(draw.result.trajectories, n)
    draw.incomplete = len({t.prompt_index for t in draw.result.trajectories}) - len(groups)
    draw.groups = _kept_groups(groups, keep_groups, draw)
    return draw


async def _draw_first(
    executor: Executor,
    drawn: Sequence[Prompt],
    *,
    n: int,
    need: int,
    seed: int | None,
    keep_groups: GroupFilter | None,
) -> _Draw:
    """The first ``need`` groups to finish of the drawn prompts (one executor call each, all
    at once; a prompt's samples and seeds are what one call over every prompt would give),
    ordered as drawn; the calls still running then are cancelled."""
    calls = {
        asyncio.ensure_future(
            executor.run(
                prompts=[p.text], labels=[p.label], n_samples_per_prompt=n,
                prompt_indices=[i], seed=seed,
            )
        ): i
        for i, p in enumerate(drawn)
    }  # fmt: skip
    draw = _Draw()
    kept: dict[int, list[Trajectory]] = {}
    results: list[ExecutorResult] = []
    pending = set(calls)
    try:
        while pending and len(kept) < need:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=calls.__getitem__):
                result = task.result()
                results.append(result)
                groups = complete_groups(result.trajectories, n)
                draw.incomplete += len({t.prompt_index for t in result.trajectories}) - len(groups)
                for group in _kept_groups(groups, keep_groups, draw):
                    if len(kept) < need:
                        kept[calls[task]] = group
                    else:
                        draw.unused += 1
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in calls:  # retrieved: a call that failed beside the one raised logs nothing
            if task.done() and not task.cancelled():
                task.exception()
    draw.cancelled = len(pending)
    draw.groups = [kept[i] for i in sorted(kept)]
    draw.result = merge_results(results)
    return draw


async def sample_step(
    step: int,
    *,
    batch_size: int,
    n_samples_per_prompt: int,
    prompts: PromptSource,
    executor: Executor,
    keep_groups: GroupFilter | None = None,
    seed: int | None = None,
    oversample: float = 1.0,
) -> Rollout:
    """``batch_size`` prompt groups of ``n_samples_per_prompt`` samples for step ``step``
    (0-based), from whatever weights the executor's engines hold.

    Args:
        keep_groups: Dynamic filtering: the groups it rejects are dropped and replaced from
            further draws (`MAX_DRAWS` in all); None keeps every complete group of one draw.
        seed: The run's seed when requests are seeded: draw ``a`` of the step seeds its
            requests from ``request_seed(seed, TRAINING, step, a)``.
        oversample: A draw that needs ``k`` groups draws ``ceil(k * oversample)`` prompts and
            keeps the first ``k`` complete, kept groups to finish; the prompts drawn beyond
            them are used up. 1 (default): one executor call over the ``k`` prompts.

    Returns:
        The `Rollout`: at most ``batch_size * n_samples_per_prompt`` trajectories, whole
        groups in draw order; metrics ``rollout/dropped_groups``, ``data/prompts_crc32`` (of
        the prompt texts drawn), ``rollout/samples_crc32`` (`samples_digest`),
        ``time/generation_s`` and the first draw's truncation, reward and environment
        metrics (with ``oversample`` > 1, of its calls that finished, merged by
        `rlhf.agents.merge_results`, and ``rollout/oversample_cancelled`` /
        ``rollout/oversample_unused``: prompts cancelled unfinished / groups that finished
        after the batch was full); ``sampler_state``: ``prompts.state_dict()`` after the
        draws; ``sources``: each trajectory's ``Prompt.source_name``.

    Raises:
        EmptyStepError: No sample is left (`empty_step_message` says why).
        ValueError: ``oversample`` < 1.
    """
    if not oversample >= 1:
        raise ValueError(f"oversample must be at least 1, got {oversample}")
    n = n_samples_per_prompt
    tick = time.perf_counter()
    trajectories: list[Trajectory] = []
    sources: list[str] = []
    first_metrics: Mapping[str, float] = {}
    dropped_groups = incomplete = cancelled = unused = 0
    lost: dict[str, float] = {}
    failure = ""
    digest = 0
    for attempt in range(MAX_DRAWS if keep_groups is not None else 1):
        need = batch_size - len(trajectories) // n
        if need <= 0:
            break
        drawn = prompts.next(math.ceil(need * oversample))
        digest = zlib.crc32("\x00".join(p.text for p in drawn).encode(), digest)
        draw_seed = None if seed is None else request_seed(seed, TRAINING, step, attempt)
        if oversample > 1:
            draw = await _draw_first(
                executor, drawn, n=n, need=need, seed=draw_seed, keep_groups=keep_groups
            )
        else:
            draw = await _draw_all(executor, drawn, n=n, seed=draw_seed, keep_groups=keep_groups)
        first_metrics = draw.result.metrics if attempt == 0 else first_metrics
        for key in ("env/skipped", "reward/failed"):
            lost[key] = lost.get(key, 0.0) + draw.result.metrics.get(key, 0.0)
        failure = failure or draw.result.failure
        incomplete += draw.incomplete
        dropped_groups += draw.dropped
        cancelled += draw.cancelled
        unused += draw.unused
        trajectories += [tr for g in draw.groups for tr in g]
        sources += [drawn[tr.prompt_index].source_name for g in draw.groups for tr in g]
    trajectories = trajectories[: batch_size * n]
    sources = sources[: batch_size * n]
    if not trajectories:
        raise EmptyStepError(
            empty_step_message(
                step, dropped_groups=dropped_groups, incomplete=incomplete, lost=lost,
                failure=failure,
            )
        )  # fmt: skip
    metrics: dict[str, float] = {
        "rollout/dropped_groups": float(dropped_groups),
        "data/prompts_crc32": digest,
        "rollout/samples_crc32": samples_digest(trajectories),
        **{k: float(v) for k, v in first_metrics.items() if k.startswith(_KEPT_METRICS)},
        "time/generation_s": time.perf_counter() - tick,
    }
    if oversample > 1:
        metrics["rollout/oversample_cancelled"] = float(cancelled)
        metrics["rollout/oversample_unused"] = float(unused)
    return Rollout(
        step=step,
        trajectories=trajectories,
        metrics=metrics,
        sampler_state=prompts.state_dict(),
        sources=sources,
    )


def samples_digest(trajectories: Sequence[Trajectory]) -> int:
    """CRC-32 of the trajectories' token ids, in batch order, each sample preceded by its
    length: equal digests, equal samples. (Packed 64-bit integers: a fifth of the time of
    their decimal text, 10 ms per 0.5M tokens on a 2-core CPU; it runs on every step.)"""
    digest = 0
    for tr in trajectories:
        digest = zlib.crc32(array.array("q", (len(tr.token_ids), *tr.token_ids)).tobytes(), digest)
    return digest


def staleness(step: int, trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """How many updates behind the trained policy (version ``step``) each sample's weights
    were: mean and max over the samples whose engine reported a version."""
    behind = [step - t.weight_version for t in trajectories if t.weight_version is not None]
    if not behind:
        return {}
    return {
        "rollout/staleness_mean": sum(behind) / len(behind),
        "rollout/staleness_max": float(max(behind)),
    }


async def evaluate(
    executor: Executor,
    prompts: Mapping[str, Sequence[Prompt]],
    *,
    n_samples: int,
    solved_threshold: float,
    seed: int | None = None,
) -> dict[str, float]:
    """Per evaluation source ``name``: ``eval/<name>/<metric>`` of `pass_at` over its
    prompts' ``n_samples`` scores. ``seed`` (the run's, when requests are seeded): source
    ``i`` seeds its requests from ``request_seed(seed, EVALUATION, i)`` at every evaluation,
    so evaluations differ only by the weights."""
    out: dict[str, float] = {}
    for i, (name, items) in enumerate(prompts.items()):
        result = await executor.run(
            prompts=[p.text for p in items],
            labels=[p.label for p in items],
            n_samples_per_prompt=n_samples,
            seed=None if seed is None else request_seed(seed, EVALUATION, i),
        )
        scores: dict[int, list[float]] = {}
        for t in result.trajectories:
            scores.setdefault(t.prompt_index, []).append(float(t.score))
        per_prompt = [scores.get(k, [0.0]) for k in range(len(items))]
        for metric, value in pass_at(per_prompt, k=n_samples, threshold=solved_threshold).items():
            out[f"eval/{name}/{metric}"] = value
    return out


def pass_at(scores: Sequence[Sequence[float]], *, k: int, threshold: float) -> dict[str, float]:
    """Evaluation metrics of ``scores[prompt][sample]`` (``k`` samples each): ``pass@1`` (the
    fraction of a prompt's samples scoring at least ``threshold``, averaged over prompts),
    ``pass@k`` (the fraction of prompts with such a sample) and ``score_mean``."""
    n = max(len(scores), 1)
    solved = [[s >= threshold for s in row] for row in scores]
    return {
        "pass@1": sum(sum(row) / len(row) for row in solved if row) / n,
        f"pass@{k}": sum(any(row) for row in solved) / n,
        "score_mean": sum(sum(row) / len(row) for row in scores if row) / n,
    }
