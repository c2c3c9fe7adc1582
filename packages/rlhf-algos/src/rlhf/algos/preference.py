"""Offline preference losses: DPO, cDPO (label smoothing), IPO; pairwise reward-model losses.

DPO (arXiv 2305.18290), with the implicit-reward margin
z = (logπ_c − logπ_r) − (logπref_c − logπref_r):

- ``sigmoid``: −(1 − ε)·logσ(βz) − ε·logσ(−βz); ε = 0 is DPO, ε > 0 is cDPO (conservative DPO
  with label smoothing ε, as in OpenRLHF and TRL).
- ``ipo`` (arXiv 2310.12036): (z − 1/(2β))². The paper uses length-averaged log-probs: pass
  per-token-mean log-probs for that form, summed log-probs for OpenRLHF's.

An optional NLL term (coefficient × the chosen responses' NLL, as OpenRLHF's ``nll_loss_coef``)
is added. Reward model, pairwise (Bradley-Terry): ``sigmoid`` −logσ(r_c − r_r − margin) and
``log_exp`` log(1 + exp(r_r − r_c + margin)), which are the same function written two ways.
All losses are means over pairs; pass the global pair count as ``normalizer`` under data parallel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.algos import _checks
from rlhf.algos.registry import Registry

# Family signature: fn(z: (B,), *, beta: float, label_smoothing: float) -> (B,)
PreferenceLoss = Callable[..., Tensor]
PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss")


@PREFERENCE_LOSSES.register("sigmoid", "dpo")
def sigmoid_preference(z: Tensor, *, beta: float, label_smoothing: float) -> Tensor:
    """DPO / cDPO per pair: −(1 − ε)logσ(βz) − ε·logσ(−βz). (B,) → (B,)."""
    return -(1.0 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(
        -beta * z
    )


@PREFERENCE_LOSSES.register("ipo")
def ipo_preference(z: Tensor, *, beta: float, label_smoothing: float) -> Tensor:
    """IPO per pair: (z − 1/(2β))². ``label_smoothing`` must be 0. (B,) → (B,)."""
    if label_smoothing != 0.0:
        raise ValueError("label_smoothing applies to the sigmoid (DPO) loss only; set it to 0")
    return (z - 1.0 / (2.0 * beta)).square()


def _pair_mean(per_pair: Tensor, normalizer: float | Tensor | None) -> Tensor:
    if normalizer is None:
        normalizer = max(per_pair.shape[0], 1)
    elif isinstance(normalizer, int | float) and not (math.isfinite(normalizer) and normalizer > 0):
        raise ValueError(f"normalizer must be a positive pair count, got {normalizer!r}")
    return per_pair.sum() / torch.as_tensor(
        normalizer, dtype=per_pair.dtype, device=per_pair.device
    )


def _pairs(**tensors: Tensor | None) -> Tensor:
    first_name, first = next(iter(tensors.items()))
    ref = _checks.floating(first_name, first, ndim=1)
    for name, value in tensors.items():
        if value is not None:
            _checks.floating(name, value)
    _checks.same_shape(first_name, ref, **tensors)
    return ref


def dpo_loss(
    *,
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_nll: Tensor | None = None,
    nll_coef: float = 0.0,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO-family loss over preference pairs.

    Args:
        chosen_logps: (B,) policy log-prob of each chosen response (summed over its tokens).
        rejected_logps: (B,) policy log-prob of each rejected response.
        ref_chosen_logps: (B,) reference log-prob of the chosen response (detached here).
        ref_rejected_logps: (B,) reference log-prob of the rejected response (detached here).
        beta: β > 0.
        loss_type: Name in `PREFERENCE_LOSSES`: sigmoid (alias dpo) or ipo.
        label_smoothing: ε in [0, 0.5) for cDPO.
        chosen_nll: (B,) NLL of each chosen response (e.g. its token-mean NLL), with ``nll_coef``.
        nll_coef: Weight of the NLL term, >= 0.
        normalizer: Global number of pairs under data parallel; None uses B.

    Returns:
        (0-dim loss, metrics: dpo/loss, dpo/chosen_reward, dpo/rejected_reward, dpo/accuracy,
        dpo/margin, and dpo/nll when used).
    """
    c = _pairs(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        chosen_nll=chosen_nll,
    )
    b = _checks.positive("beta", beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio = c - ref_chosen_logps.detach()
    rejected_ratio = rejected_logps - ref_rejected_logps.detach()
    z = chosen_ratio - rejected_ratio
    per_pair = PREFERENCE_LOSSES.get(loss_type)(z, beta=b, label_smoothing=label_smoothing)
    metrics: dict[str, Tensor] = {}
    if nll_coef:
        if chosen_nll is None:
            raise ValueError("chosen_nll is required when nll_coef > 0")
        _checks.positive("nll_coef", nll_coef)
        per_pair = per_pair + nll_coef * chosen_nll
        metrics["dpo/nll"] = chosen_nll.detach().mean()
    loss = _pair_mean(per_pair, normalizer)
    chosen_reward = (b * chosen_ratio).detach()
    rejected_reward = (b * rejected_ratio).detach()
    metrics.update(
        {
            "dpo/loss": loss.detach(),
            "dpo/chosen_reward": chosen_reward.mean(),
            "dpo/rejected_reward": rejected_reward.mean(),
            "dpo/accuracy": (chosen_reward > rejected_reward).float().mean(),
            "dpo/margin": (chosen_reward - rejected_reward).mean(),
        }
    )
    return loss, metrics


# Family signature: fn(chosen: (B,), rejected: (B,), margin: (B,)) -> (B,)
RewardModelLoss = Callable[[Tensor, Tensor, Tensor], Tensor]
REWARD_MODEL_LOSSES: Registry[RewardModelLoss] = Registry("reward model loss")


@REWARD_MODEL_LOSSES.register("sigmoid")
def pairwise_sigmoid(chosen: Tensor, rejected: Tensor, margin: Tensor) -> Tensor:
    """−logσ(r_c − r_r − margin). (B,) → (B,)."""
    return -F.logsigmoid(chosen - rejected - margin)


@REWARD_MODEL_LOSSES.register("log_exp")
def pairwise_log_exp(chosen: Tensor, rejected: Tensor, margin: Tensor) -> Tensor:
    """log(1 + exp(r_r − r_c + margin)), computed as a stable softplus. (B,) → (B,)."""
    return F.softplus(rejected - chosen + margin)


def reward_model_loss(
    *,
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    margin: Tensor | None = None,
    loss_type: str = "sigmoid",
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Pairwise reward-model loss.

    Args:
        chosen_rewards: (B,) scalar reward of each chosen response.
        rejected_rewards: (B,) scalar reward of each rejected response.
        margin: (B,) required margin per pair, or None for 0.
        loss_type: Name in `REWARD_MODEL_LOSSES`: sigmoid or log_exp.
        normalizer: Global number of pairs under data parallel; None uses B.

    Returns:
        (0-dim loss, metrics: rm/loss, rm/accuracy, rm/chosen_mean, rm/rejected_mean, rm/margin).
    """
    c = _pairs(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards, margin=margin)
    m = torch.zeros_like(c) if margin is None else margin.to(c.dtype)
    loss = _pair_mean(REWARD_MODEL_LOSSES.get(loss_type)(c, rejected_rewards, m), normalizer)
    gap = (c - rejected_rewards).detach()
    return loss, {
        "rm/loss": loss.detach(),
        "rm/accuracy": (gap > 0).float().mean(),
        "rm/chosen_mean": c.detach().mean(),
        "rm/rejected_mean": rejected_rewards.detach().mean(),
        "rm/margin": gap.mean(),
    }
