"""Train/rollout mismatch correction: importance weights between the learner and the sampler.

vLLM samples with its own kernels, so its log-probs of the sampled tokens (logπ_rollout) differ
from the learner's logπ_old for the same weights. With δ = logπ_old − logπ_rollout and
w_t = exp(δ_t), the per-token loss is multiplied by a detached weight w' chosen by a *level*
(which statistic is compared with the threshold [lo, hi]) and a *mode*:

- level ``token``: statistic w_t.
- level ``sequence``: statistic exp(Σ_t δ_t), the sequence likelihood ratio.
- level ``geometric``: statistic exp(mean_t δ_t), the per-token geometric mean ratio.
- mode ``truncate``: w' = clamp(statistic, lo, hi) (token level: TIS).
- mode ``mask``: w' = w_t · 1[lo <= statistic <= hi] (token level: IcePop; sequence levels keep
  or drop whole sequences and weight kept tokens by their own w_t).

A *gating* other than ``ratio`` compares a divergence between the two policies at the sampled
token with the threshold instead of the ratio (a trust region, OpenRLHF 0.11's
``--algo.advantage.is_correction_gating``): with p = π_rollout(y_t) and q = π_old(y_t), both
clamped to [1e-6, 1 − 1e-6],

- ``binary_kl``: d_t = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)), the KL between the two
  policies collapsed to {y_t, not y_t};
- ``tv``: d_t = |p − q|.

Its statistic is d_t (level ``token``) or the sequence's mean of d_t (level ``geometric``), it
masks only (kept tokens weighted by their own w_t; FlashREINFORCE's trust region is
``geometric`` + ``binary_kl``) and its threshold is an upper bound: lo = 0.

OpenRLHF's default threshold is [0.5, 5.0]. Weights outside the action mask are 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algos import _checks
from rlhf.algos.masked import masked_mean, masked_sum
from rlhf.algos.registry import Registry

LOG_RATIO_CLAMP = 20.0

# Family signature: fn(delta: (B, T), mask: (B, T)) -> (B, T) statistic, broadcast per sequence
CorrectionLevel = Callable[[Tensor, Tensor], Tensor]
CORRECTION_LEVELS: Registry[CorrectionLevel] = Registry("rollout correction level")


@CORRECTION_LEVELS.register("token")
def token_level(delta: Tensor, mask: Tensor) -> Tensor:
    """w_t = exp(δ_t). (B, T) → (B, T)."""
    return torch.exp(delta)


@CORRECTION_LEVELS.register("sequence")
def sequence_level(delta: Tensor, mask: Tensor) -> Tensor:
    """exp(Σ_t δ_t) per sequence, broadcast over its tokens. (B, T) → (B, T)."""
    total = masked_sum(delta, mask, dim=1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(total).unsqueeze(1).expand_as(delta)


@CORRECTION_LEVELS.register("geometric")
def geometric_level(delta: Tensor, mask: Tensor) -> Tensor:
    """exp(mean_t δ_t) per sequence, broadcast over its tokens. (B, T) → (B, T)."""
    return torch.exp(masked_mean(delta, mask, dim=1)).unsqueeze(1).expand_as(delta)


CORRECTION_MODES = ("truncate", "mask")

PROBABILITY_CLAMP = 1e-6
"""p and q of a divergence gate are clamped to [this, 1 − this] (finite logs)."""

# Family signature: fn(p_rollout: (B, T), q_old: (B, T)) -> (B, T) divergence at the token
CorrectionDivergence = Callable[[Tensor, Tensor], Tensor]
CORRECTION_DIVERGENCES: Registry[CorrectionDivergence] = Registry("rollout correction gating")


@CORRECTION_DIVERGENCES.register("binary_kl")
def binary_kl(p: Tensor, q: Tensor) -> Tensor:
    """p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)). (B, T), (B, T) → (B, T)."""
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


@CORRECTION_DIVERGENCES.register("tv")
def total_variation(p: Tensor, q: Tensor) -> Tensor:
    """|p − q|. (B, T), (B, T) → (B, T)."""
    return (p - q).abs()


CORRECTION_GATINGS = ("ratio", *CORRECTION_DIVERGENCES.names())
"""What a correction's threshold is compared with: the ratio, or a divergence."""


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance-sampling correction between learner and rollout log-probs.

    Attributes:
        level: Name in `CORRECTION_LEVELS`: token, sequence or geometric.
        mode: ``truncate`` (clamp the statistic) or ``mask`` (drop tokens/sequences outside).
        threshold: (lo, hi) with 0 <= lo < hi.
        gating: ``ratio`` (the threshold bounds the ratio) or a `CORRECTION_DIVERGENCES` name
            (it bounds that divergence: mode ``mask``, level token or geometric, lo = 0).
    """

    level: str = "token"
    mode: str = "truncate"
    threshold: tuple[float, float] = (0.5, 5.0)
    gating: str = "ratio"

    def __post_init__(self) -> None:
        CORRECTION_LEVELS.canonical(self.level)
        if self.mode not in CORRECTION_MODES:
            raise ValueError(
                f"rollout_correction.mode {self.mode!r} is unknown; choose one of: "
                f"{', '.join(CORRECTION_MODES)}"
            )
        low, _ = _checks.interval("rollout_correction.threshold", self.threshold, strict=True)
        if low < 0:
            raise ValueError(f"rollout_correction.threshold must be >= 0, got {self.threshold}")
        if self.gating == "ratio":
            return
        CORRECTION_DIVERGENCES.canonical(self.gating)
        problems = [
            what
            for bad, what in (
                (self.mode != "mask", f"mode mask (not {self.mode})"),
                (
                    CORRECTION_LEVELS.canonical(self.level) == "sequence",
                    "level token or geometric (a divergence has no sequence product)",
                ),
                (low != 0, f"an upper bound only: threshold (0, HIGH), not {self.threshold}"),
            )
            if bad
        ]
        if problems:
            raise ValueError(
                f"rollout_correction.gating {self.gating} needs " + "; ".join(problems)
            )


def rollout_correction_weights(
    *,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    action_mask: Tensor,
    config: RolloutCorrectionConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached per-token importance weights w' correcting for the train/rollout mismatch.

    Args:
        old_logprobs: (B, T) learner log-probs of the sampled tokens before the update.
        rollout_logprobs: (B, T) the sampler's log-probs of the same tokens.
        action_mask: (B, T).
        config: Level, mode and threshold.

    Returns:
        (weights (B, T) detached and 0 outside the mask, float32 for half inputs; metrics).
    """
    old = _checks.floating("old_logprobs", old_logprobs, ndim=2)
    rollout = _checks.floating("rollout_logprobs", rollout_logprobs)
    _checks.same_shape("old_logprobs", old, rollout_logprobs=rollout)
    m = _checks.mask("action_mask", action_mask, like=old, like_name="old_logprobs")
    low, high = config.threshold
    delta = _checks.upcast(old.detach()) - _checks.upcast(rollout.detach())
    delta = _checks.zero_masked(delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), m)
    statistic = _statistic(old, rollout, delta, m, config)
    inside = (statistic >= low) & (statistic <= high)
    if config.mode == "truncate":
        weights = statistic.clamp(min=low, max=high)
    else:
        weights = torch.exp(delta) * inside.to(delta.dtype)
    weights = torch.where(m > 0, weights, torch.zeros_like(weights))
    outside = (~inside).to(delta.dtype)
    metrics = {
        "rollout_correction/outside_frac": masked_mean(outside, m).detach(),
        "rollout_correction/weight_mean": masked_mean(weights, m).detach(),
        # k3 estimate of KL(rollout || old) from the rollout's own samples.
        "rollout_correction/mismatch_kl": masked_mean(torch.expm1(delta) - delta, m).detach(),
    }
    return weights.detach(), metrics


def _statistic(
    old: Tensor, rollout: Tensor, delta: Tensor, mask: Tensor, config: RolloutCorrectionConfig
) -> Tensor:
    """What the threshold bounds, (B, T): the level's ratio statistic, or the gating's
    divergence per token (level token) or its per-sequence mean (level geometric)."""
    if config.gating == "ratio":
        return CORRECTION_LEVELS.get(config.level)(delta, mask)
    bound = (PROBABILITY_CLAMP, 1 - PROBABILITY_CLAMP)
    p = torch.exp(_checks.upcast(rollout.detach())).clamp(*bound)
    q = torch.exp(_checks.upcast(old.detach())).clamp(*bound)
    # A divergence is >= 0; binary_kl's two terms cancel to a few float32 ulps below 0 where
    # p ≈ q, which the gate's lower bound 0 would mask (37 % of tokens agreeing to 1e-6).
    divergence = CORRECTION_DIVERGENCES.get(config.gating)(p, q).clamp(min=0)
    divergence = _checks.zero_masked(divergence, mask)
    if CORRECTION_LEVELS.canonical(config.level) == "token":
        return divergence
    return masked_mean(divergence, mask, dim=1).unsqueeze(1).expand_as(divergence)
