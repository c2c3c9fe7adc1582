"""The contracts of rlhf.agents: sampling parameters, generations, the Generator protocol and
the Trajectory every executor returns."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


@runtime_checkable
class _ArrayLike(Protocol):
    """A numpy or torch value: a scalar when ``ndim == 0``, its Python number from ``item()``."""

    ndim: int

    def item(self) -> object: ...


def finite_float(value: object) -> float | None:
    """``value`` as a finite float, or None. Accepts Python, numpy and 0-d torch numbers;
    refuses bools, strings, None and NaN/inf."""
    if isinstance(value, _ArrayLike) and value.ndim == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


@dataclass(frozen=True)
class SamplingParams:
    """How one completion is sampled (vLLM's conventions).

    Attributes:
        max_new_tokens: Upper bound on generated tokens.
        temperature: Softmax temperature; 0 means greedy.
        top_p: Nucleus sampling mass in (0, 1].
        top_k: Keep the k most likely tokens; -1 disables.
        stop: Stop strings (the stop string is not part of the output).
        stop_token_ids: Token ids that end generation (kept in the output, like EOS).
        seed: Per-request seed, or None.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")

    def replace(self, **overrides: object) -> SamplingParams:
        """A copy with ``overrides`` applied; unknown names are a `ValueError`."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **overrides)


@dataclass(frozen=True)
class Generation:
    """One completion in token space.

    Attributes:
        token_ids: (L,) sampled token ids, exactly as the engine produced them.
        logprobs: (L,) the engine's log-prob of each sampled token.
        finish_reason: ``stop`` (EOS, stop token or string), ``length`` or ``abort``.
        weight_version: Version of the weights that produced it, if the engine tracks one.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    weight_version: int | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Generation has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs"
            )


@runtime_checkable
class Generator(Protocol):
    """Anything that samples a completion from prompt token ids (a vLLM engine, a pool, …)."""

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Generation: ...


@runtime_checkable
class GroupGenerator(Generator, Protocol):
    """A `Generator` that also samples ``n`` completions of one prompt in one request (vLLM's
    ``n``): sample ``i`` is the one ``generate`` draws with `rlhf.agents.nth_sample` of
    ``sampling`` (seed ``+ i``), so only the cost differs (`rlhf.agents.sample_group`)."""

    async def generate_group(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams, n: int
    ) -> list[Generation]: ...


@dataclass(frozen=True)
class Trajectory:
    """One sampled episode, in token space, ready for the learner.

    Attributes:
        token_ids: (L,) prompt + policy actions + environment feedback, never re-tokenized.
        action_mask: (L,) 1 where the policy produced the token.
        rollout_logprobs: (L,) the sampler's log-prob at action tokens, 0 elsewhere.
        prompt_length: Number of leading prompt tokens.
        reward: Scalar reward (sum of turn rewards for multi-turn episodes).
        turn_rewards: Reward of each turn (one entry for single-turn).
        score: Score for filtering and pass@k (defaults to the reward).
        truncated: The episode hit a length or turn limit instead of ending by itself.
        finish_reason: Finish reason of the last generation.
        metrics: Scalar diagnostics (reward extras, environment metrics).
        prompt_index: Index of the prompt in its batch.
        sample_index: Index of the sample among the prompt's n samples.
        weight_version: Weight version of the last generation, if known.
        turn_ends: Index in ``token_ids`` of each turn's last action token, one per entry of
            ``turn_rewards`` (where per-turn credit places that turn's reward); empty when
            the executor does not know its turns.
    """

    token_ids: tuple[int, ...]
    action_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    prompt_length: int
    reward: float
    turn_rewards: tuple[float, ...]
    score: float
    truncated: bool
    finish_reason: FinishReason
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_index: int = 0
    sample_index: int = 0
    weight_version: int | None = None
    turn_ends: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.action_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"Trajectory streams disagree: {n} token ids, {len(self.action_mask)} mask "
                f"entries, {len(self.rollout_logprobs)} logprobs"
            )
        if not 0 <= self.prompt_length <= n or any(self.action_mask[: self.prompt_length]):
            raise ValueError(f"prompt_length={self.prompt_length} is inconsistent with the mask")
        if self.turn_ends and (
            len(self.turn_ends) != len(self.turn_rewards)
            or any(not 0 <= i < n or not self.action_mask[i] for i in self.turn_ends)
        ):
            raise ValueError(
                f"turn_ends={self.turn_ends} must name one action token per turn reward "
                f"({len(self.turn_rewards)})"
            )
        if not (math.isfinite(self.reward) and math.isfinite(self.score)):
            raise ValueError(
                f"Trajectory reward/score must be finite, got {self.reward}/{self.score}"
            )

    @property
    def response_length(self) -> int:
        """Tokens after the prompt (actions and feedback)."""
        return len(self.token_ids) - self.prompt_length

    @property
    def num_action_tokens(self) -> int:
        """Tokens the policy produced."""
        return sum(self.action_mask)
