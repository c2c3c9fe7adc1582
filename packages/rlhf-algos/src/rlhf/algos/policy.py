"""Policy-gradient losses: PPO clip (asymmetric ε, dual-clip), GSPO and CISPO.

Each registry entry returns a **per-token** loss (B, T); aggregation over tokens and sequences is
a separate step (`rlhf.algos.aggregation`). `policy_loss` composes a registry entry, the optional
train/rollout importance correction and the aggregation.

ρ_t = exp(logπ_t − logπ_old,t), with the log-ratio clamped to ±20 before exp for stability.

- ``ppo`` (arXiv 1707.06347): ℓ = −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)·A). ε_high > ε_low is
  DAPO's clip-higher (arXiv 2503.14476). With ``dual_clip`` = c > 1 (arXiv 1912.09729), tokens
  with A < 0 get ℓ = −max(min(ρA, clip(ρ)A), c·A).
- ``gspo`` (arXiv 2507.18071): the sequence ratio s_i = exp(mean_t(logπ − logπ_old)) replaces
  ρ, in the stop-gradient token form s_{i,t} = sg[s_i]·π_t/sg[π_t], so each token has its own
  gradient and per-token advantages remain possible. Use with ``seq-mean-token-mean``
  aggregation to reproduce the paper's sequence objective. Dual-clip does not apply.
- ``cispo`` (arXiv 2506.13585): ℓ = −sg(clip(ρ, 1 − ε_low^IS, 1 + ε_high^IS))·A·logπ. The
  clipped ratio is a detached weight, so every token keeps a gradient. Defaults
  (ε_low^IS = 1, ε_high^IS = 3) give a one-sided cap of ρ at 4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algos import _checks
from rlhf.algos.aggregation import AGGREGATIONS, aggregate_loss
from rlhf.algos.correction import RolloutCorrectionConfig, rollout_correction_weights
from rlhf.algos.masked import masked_mean
from rlhf.algos.registry import Registry

LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class PolicyLossConfig:
    """Policy loss variant and its parameters (flags ``--algo.policy_loss.*``).

    Attributes:
        name: Name in `POLICY_LOSSES`: ppo, gspo or cispo.
        clip_eps_low: ε_low of the ratio clip (ppo, gspo).
        clip_eps_high: ε_high of the ratio clip; > ε_low is clip-higher (ppo, gspo).
        dual_clip: c > 1 enables dual-clip for A < 0 (ppo only); None disables.
        cispo_eps_low: ε_low^IS of CISPO's weight clip.
        cispo_eps_high: ε_high^IS of CISPO's weight clip.
    """

    name: str = "ppo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None
    cispo_eps_low: float = 1.0
    cispo_eps_high: float = 3.0

    def __post_init__(self) -> None:
        POLICY_LOSSES.canonical(self.name)
        for field_name in ("clip_eps_low", "clip_eps_high", "cispo_eps_low", "cispo_eps_high"):
            _checks.positive(f"policy_loss.{field_name}", getattr(self, field_name))
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"policy_loss.dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.dual_clip is not None and POLICY_LOSSES.canonical(self.name) != "ppo":
            raise ValueError(
                f"policy_loss.dual_clip applies to 'ppo' only, not {self.name!r}; set it to None"
            )


# Family signature:
#   fn(*, logprobs, old_logprobs, advantages, action_mask, config) -> (loss (B, T), metrics)
PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    return (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _inputs(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, action_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Upcast half precision (exp of a ratio overflows float16) and zero masked entries so a
    NaN/inf there reaches neither the loss nor any gradient."""
    m = action_mask
    return (
        _checks.zero_masked(_checks.upcast(logprobs), m),
        _checks.zero_masked(_checks.upcast(old_logprobs.detach()), m),
        _checks.zero_masked(_checks.upcast(advantages.detach()), m),
    )


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, mask: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    low, high = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    surr1 = ratio * advantages
    surr2 = ratio.clamp(low, high) * advantages
    loss = -torch.minimum(surr1, surr2)
    metrics = {"actor/clip_ratio": masked_mean((surr2 < surr1).to(ratio.dtype), mask).detach()}
    if config.dual_clip is not None:
        dual = -config.dual_clip * advantages
        use_dual = (advantages < 0) & (dual < loss)
        loss = torch.where(use_dual, dual, loss)
        metrics["actor/dual_clip_ratio"] = masked_mean(use_dual.to(ratio.dtype), mask).detach()
    return loss, metrics


def _ratio_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    ratio = torch.exp(log_ratio)
    return {
        # k3 estimate of KL(π_old || π) from samples of π_old.
        "actor/approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask).detach(),
        "actor/ratio_mean": masked_mean(ratio, mask).detach(),
    }


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    config: PolicyLossConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric ε and optional dual-clip; all tensors (B, T)."""
    logprobs, old_logprobs, advantages = _inputs(logprobs, old_logprobs, advantages, action_mask)
    log_ratio = _log_ratio(logprobs, old_logprobs)
    loss, metrics = _clipped_surrogate(torch.exp(log_ratio), advantages, action_mask, config)
    return loss, {**metrics, **_ratio_metrics(log_ratio.detach(), action_mask)}


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    config: PolicyLossConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO in the stop-gradient token form; all tensors (B, T)."""
    logprobs, old_logprobs, advantages = _inputs(logprobs, old_logprobs, advantages, action_mask)
    log_ratio = _log_ratio(logprobs, old_logprobs)
    seq_log_ratio = masked_mean(log_ratio, action_mask, dim=1).unsqueeze(1)
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    ratio = torch.exp(token_log_ratio.clamp(max=LOG_RATIO_CLAMP))
    loss, metrics = _clipped_surrogate(ratio, advantages, action_mask, config)
    metrics["actor/seq_ratio_mean"] = masked_mean(ratio.detach(), action_mask).detach()
    return loss, {**metrics, **_ratio_metrics(log_ratio.detach(), action_mask)}


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    config: PolicyLossConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE with a detached, clipped importance weight; all tensors (B, T)."""
    logprobs, old_logprobs, advantages = _inputs(logprobs, old_logprobs, advantages, action_mask)
    log_ratio = _log_ratio(logprobs, old_logprobs).detach()
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - config.cispo_eps_low, 1.0 + config.cispo_eps_high
    weight = ratio.clamp(low, high)
    loss = -weight * advantages * logprobs
    clipped = ((ratio < low) | (ratio > high)).to(ratio.dtype)
    metrics = {"actor/clip_ratio": masked_mean(clipped, action_mask).detach()}
    return loss, {**metrics, **_ratio_metrics(log_ratio, action_mask)}


def policy_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    config: PolicyLossConfig,
    aggregation: str = "token-mean",
    normalizer: float | Tensor | None = None,
    max_len: int | None = None,
    rollout_logprobs: Tensor | None = None,
    rollout_correction: RolloutCorrectionConfig | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token policy loss × optional rollout correction weights, aggregated.

    Args:
        logprobs: (B, T) current log-probs of the sampled tokens (with gradient).
        old_logprobs: (B, T) log-probs before the update (detached here).
        advantages: (B, T), 0 outside the mask.
        action_mask: (B, T).
        config: Which loss and its parameters.
        aggregation: Name in `AGGREGATIONS`.
        normalizer: Global normaliser for exactness under DP/accumulation (see aggregation).
        max_len: L_max for ``seq-mean-token-sum-norm``.
        rollout_logprobs: (B, T) the sampler's log-probs, required with ``rollout_correction``.
        rollout_correction: Importance correction config, or None for none.

    Returns:
        (0-dim loss, metrics). ``actor/pg_loss`` holds the loss value.
    """
    lp = _checks.floating("logprobs", logprobs, ndim=2)
    _checks.same_shape("logprobs", lp, old_logprobs=old_logprobs, advantages=advantages)
    _checks.floating("old_logprobs", old_logprobs)
    _checks.floating("advantages", advantages)
    m = _checks.mask("action_mask", action_mask, like=lp, like_name="logprobs")
    AGGREGATIONS.canonical(aggregation)
    fn = POLICY_LOSSES.get(config.name)
    per_token, metrics = fn(
        logprobs=lp,
        old_logprobs=old_logprobs,
        advantages=advantages.detach(),
        action_mask=m,
        config=config,
    )
    if rollout_correction is not None:
        if rollout_logprobs is None:
            raise ValueError("rollout_logprobs are required when rollout_correction is set")
        weights, correction_metrics = rollout_correction_weights(
            old_logprobs=old_logprobs,
            rollout_logprobs=rollout_logprobs,
            action_mask=m,
            config=rollout_correction,
        )
        per_token = per_token * weights
        metrics.update(correction_metrics)
    loss = aggregate_loss(per_token, m, mode=aggregation, normalizer=normalizer, max_len=max_len)
    metrics["actor/pg_loss"] = loss.detach()
    return loss, metrics
