"""Single-turn executor: prompt text → tokens → n generations → one batched reward call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rlhf.agents._aio import gather_or_cancel
from rlhf.agents.groups import sample_group
from rlhf.agents.rewards import RewardScorer
from rlhf.agents.seeds import group_seed
from rlhf.agents.tokens import Tokenizer, encode_prompt
from rlhf.agents.types import Generation, Generator, SamplingParams, Trajectory


@dataclass
class ExecutorResult:
    """Trajectories of a batch and what happened on the way.

    Attributes:
        trajectories: Valid samples, ordered by (prompt_index, sample_index). Samples dropped by
            a ``skip`` reward policy are absent, so a prompt group can be incomplete.
        metrics: Counts and means (``rollout/*``, ``reward/*``).
        failure: The first failure a ``skip`` or ``fallback`` policy absorbed (an episode's
            error), so a step left with nothing can say why; empty when none.
    """

    trajectories: list[Trajectory]
    metrics: dict[str, float] = field(default_factory=dict)
    failure: str = ""


MEANS = ("_mean", "_frac")
"""Suffixes of an executor metric that is a mean over the call's samples (``rollout/samples``
of them); ``_max`` and ``_min`` are extremes; any other metric is a count."""


def merge_results(results: Sequence[ExecutorResult]) -> ExecutorResult:
    """One `ExecutorResult` of several calls' (each over its own prompts): the trajectories in
    call order, the first failure, and each metric merged by its name — a mean (`MEANS`)
    weighted by each call's ``rollout/samples`` (1 where a call does not report it), ``_max``
    the largest, ``_min`` the smallest, any other the sum."""
    merged: dict[str, float] = {}
    weights: dict[str, float] = {}
    for result in results:
        weight = result.metrics.get("rollout/samples", 1.0)
        for key, value in result.metrics.items():
            if key.endswith(MEANS):
                merged[key] = merged.get(key, 0.0) + weight * value
                weights[key] = weights.get(key, 0.0) + weight
            elif key.endswith("_max"):
                merged[key] = max(merged.get(key, value), value)
            elif key.endswith("_min"):
                merged[key] = min(merged.get(key, value), value)
            else:
                merged[key] = merged.get(key, 0.0) + value
    for key, total in weights.items():
        merged[key] = merged[key] / total if total else 0.0
    return ExecutorResult(
        trajectories=[t for r in results for t in r.trajectories],
        metrics=merged,
        failure=next((r.failure for r in results if r.failure), ""),
    )


class Executor(Protocol):
    """What turns a batch of prompts into scored trajectories: `SingleTurnExecutor`,
    `MultiTurnExecutor`, `OpenAIAgentExecutor` and the OpenRLHF agent runner alike."""

    async def run(
        self,
        *,
        prompts: Sequence[str],
        labels: Sequence[object],
        n_samples_per_prompt: int = 1,
        prompt_indices: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> ExecutorResult:
        """``n_samples_per_prompt`` samples of each prompt (``prompt_indices`` name the
        prompts in the trajectories; default their positions), requests seeded from ``seed``."""
        ...


def batch_indices(
    prompts: Sequence[str],
    labels: Sequence[object],
    *,
    n_samples_per_prompt: int,
    prompt_indices: Sequence[int] | None,
) -> list[int]:
    """Validate an executor batch and return the prompt index of each prompt."""
    if len(prompts) != len(labels):
        raise ValueError(f"got {len(prompts)} prompts but {len(labels)} labels")
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
    if prompt_indices is None:
        return list(range(len(prompts)))
    if len(prompt_indices) != len(prompts):
        raise ValueError(f"got {len(prompt_indices)} prompt_indices for {len(prompts)} prompts")
    return list(prompt_indices)


class SingleTurnExecutor:
    """Generate ``n_samples_per_prompt`` completions per prompt and score them in one batch.

    Args:
        tokenizer: Tokenizes the already templated prompts (no special tokens added).
        generator: Samples completions in token space.
        reward: Scores the completed samples.
        sampling: Sampling parameters; ``max_new_tokens`` is the completion budget.
        max_len: Budget of prompt + completion tokens; prompts are left-truncated to
            ``max_len − max_new_tokens``.
    """

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        generator: Generator,
        reward: RewardScorer,
        sampling: SamplingParams,
        max_len: int,
    ) -> None:
        if max_len <= sampling.max_new_tokens:
            raise ValueError(
                f"max_len={max_len} must exceed sampling.max_new_tokens={sampling.max_new_tokens}"
            )
        self.tokenizer = tokenizer
        self.generator = generator
        self.reward = reward
        self.sampling = sampling
        self.max_len = max_len

    async def run(
        self,
        *,
        prompts: Sequence[str],
        labels: Sequence[object],
        n_samples_per_prompt: int = 1,
        prompt_indices: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> ExecutorResult:
        """Run the batch; see `ExecutorResult`.

        A prompt's samples go to the generator as one group (`rlhf.agents.sample_group`: one
        engine request with ``n`` where the generator takes one). ``seed``: when set, sample
        ``s`` of the prompt at index ``i`` (``prompt_indices``) is drawn with seed
        ``group_seed(seed, i) + s``, whatever else the engine runs beside it.
        """
        indices = batch_indices(
            prompts,
            labels,
            n_samples_per_prompt=n_samples_per_prompt,
            prompt_indices=prompt_indices,
        )
        budget = self.max_len - self.sampling.max_new_tokens
        encoded = [encode_prompt(self.tokenizer, p, max_prompt_len=budget) for p in prompts]
        jobs = [(p, s) for p in range(len(prompts)) for s in range(n_samples_per_prompt)]
        groups = await gather_or_cancel(
            sample_group(
                self.generator,
                encoded[p][0],
                self._sampling(seed, indices[p]),
                n=n_samples_per_prompt,
            )
            for p in range(len(prompts))
        )
        generations: list[Generation] = [g for group in groups for g in group]
        responses = [
            self.tokenizer.decode(list(g.token_ids), skip_special_tokens=True) for g in generations
        ]
        queries = [
            self.tokenizer.decode(encoded[p][0] + list(g.token_ids), skip_special_tokens=False)
            for (p, _), g in zip(jobs, generations, strict=True)
        ]
        scored = await self.reward.score(
            queries=queries,
            prompts=[prompts[p] for p, _ in jobs],
            labels=[labels[p] for p, _ in jobs],
            responses=responses,
        )
        trajectories = []
        for k, ((p, s), g) in enumerate(zip(jobs, generations, strict=True)):
            if not scored.valid[k]:
                continue
            prompt_ids = encoded[p][0]
            extras = {name: values[k] for name, values in scored.extra_logs.items()}
            trajectories.append(
                Trajectory(
                    token_ids=tuple(prompt_ids) + g.token_ids,
                    action_mask=(0,) * len(prompt_ids) + (1,) * len(g.token_ids),
                    rollout_logprobs=(0.0,) * len(prompt_ids) + g.logprobs,
                    prompt_length=len(prompt_ids),
                    reward=scored.rewards[k],
                    turn_rewards=(scored.rewards[k],),
                    score=scored.scores[k],
                    truncated=g.finish_reason == "length",
                    finish_reason=g.finish_reason,
                    metrics=extras,
                    prompt_index=indices[p],
                    sample_index=s,
                    weight_version=g.weight_version,
                )
            )
        metrics = {
            "rollout/samples": float(len(jobs)),
            "rollout/dropped": float(len(jobs) - len(trajectories)),
            "rollout/prompts_truncated": float(sum(t for _, t in encoded)),
            "rollout/response_length_mean": sum(len(g.token_ids) for g in generations)
            / max(len(jobs), 1),
            "rollout/truncated_frac": sum(g.finish_reason == "length" for g in generations)
            / max(len(jobs), 1),
            **scored.metrics,
        }
        return ExecutorResult(trajectories=trajectories, metrics=metrics)

    def _sampling(self, seed: int | None, prompt_index: int) -> SamplingParams:
        """The sampling of a prompt's group: seeded with ``group_seed(seed, prompt_index)``
        (sample ``s`` then draws with it ``+ s``), or as configured when ``seed`` is None."""
        if seed is None:
            return self.sampling
        return self.sampling.replace(seed=group_seed(seed, prompt_index))
