"""Critic loss: PPO's clipped value loss (per token; aggregate with `rlhf.algos.aggregation`).

V_clip = V_old + clamp(V − V_old, −ε_v, ε_v); ℓ = 0.5·max((V_clip − R)², (V − R)²).
With ``clip_eps`` None the loss is the plain 0.5·(V − R)².
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algos import _checks
from rlhf.algos.masked import masked_mean


def clipped_value_loss(
    *,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    clip_eps: float | None = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped value loss.

    Args:
        values: (B, T) current critic values (with gradient).
        old_values: (B, T) values at rollout time (detached here).
        returns: (B, T) value targets (detached here).
        action_mask: (B, T).
        clip_eps: ε_v > 0, or None for no clipping.

    Returns:
        (loss (B, T), metrics with ``critic/clip_frac`` and ``critic/values_mean``).
    """
    v = _checks.floating("values", values, ndim=2)
    _checks.same_shape("values", v, old_values=old_values, returns=returns)
    m = _checks.mask("action_mask", action_mask, like=v, like_name="values")
    v = _checks.zero_masked(_checks.upcast(v), m)
    target = _checks.zero_masked(_checks.upcast(returns.detach()), m)
    unclipped = (v - target) ** 2
    if clip_eps is None:
        loss = 0.5 * unclipped
        clip_frac = torch.zeros((), dtype=v.dtype, device=v.device)
    else:
        eps = _checks.positive("clip_eps", clip_eps)
        old = _checks.zero_masked(_checks.upcast(old_values.detach()), m)
        v_clipped = old + (v - old).clamp(-eps, eps)
        clipped = (v_clipped - target) ** 2
        loss = 0.5 * torch.maximum(clipped, unclipped)
        clip_frac = masked_mean((clipped > unclipped).to(v.dtype), m)
    metrics = {
        "critic/clip_frac": clip_frac.detach(),
        "critic/values_mean": masked_mean(v.detach(), m),
    }
    return loss, metrics
