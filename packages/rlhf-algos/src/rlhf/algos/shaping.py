"""Reward shaping: scalar clipping, per-token rewards with KL-in-reward, DAPO length terms.

Implemented: clipping of the scalar reward, placement of the scalar reward on the last action
token, the −β·KL per-token term, optional extra per-token rewards (e.g. per-turn environment
rewards), DAPO's overlong penalty and overlong filtering (arXiv 2503.14476), and OpenRLHF's
stop-properly penalty for truncated samples. Left out: reward normalisation with running
statistics (whitening of advantages covers its use in PPO here).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algos import _checks


def clip_rewards(rewards: Tensor, *, clip_range: tuple[float, float] | None) -> Tensor:
    """Clamp scalar rewards to ``clip_range``; None returns them unchanged.

    Args:
        rewards: (B,) float.
        clip_range: (low, high) with low <= high, e.g. OpenRLHF's default (−10, 10).
    """
    r = _checks.floating("rewards", rewards)
    if clip_range is None:
        return r
    low, high = _checks.interval("clip_range", clip_range)
    return r.clamp(min=low, max=high)


def last_action_index(action_mask: Tensor) -> Tensor:
    """Index of the last position where ``action_mask`` is set, −1 for rows without actions.

    Args:
        action_mask: (B, T).

    Returns:
        (B,) int64.
    """
    m = _checks.tensor("action_mask", action_mask)
    if m.ndim != 2:
        raise ValueError(f"action_mask must have shape (B, T), got {tuple(m.shape)}")
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    return torch.where(m > 0, positions, torch.full_like(positions, -1)).max(dim=1).values


def shape_token_rewards(
    *,
    rewards: Tensor,
    action_mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    token_rewards: Tensor | None = None,
) -> Tensor:
    """Per-token rewards: r_t = −β·kl_t on action tokens, plus the scalar reward on the last one.

    r_{b,t} = m_{b,t}·(−β·kl_{b,t} + extra_{b,t}) + R_b·1[t = last action token of b].
    A row without action tokens gets all zeros (its scalar reward has no token to sit on).

    Args:
        rewards: (B,) scalar reward per sequence (after any group baseline and clipping).
        action_mask: (B, T), 1 where the policy produced the token.
        kl: (B, T) per-token KL estimate between the policy and the reference, or None.
        kl_coef: β >= 0 (KL in reward). Use 0 when the KL enters the loss instead.
        token_rewards: (B, T) extra per-token rewards (e.g. per-turn environment rewards placed on
            the last token of each turn), or None.

    Returns:
        (B, T) float, same dtype as ``rewards``; 0 outside the action mask; no gradient (the
        inputs, a KL estimate computed with gradient included, are detached).
    """
    r = _checks.floating("rewards", rewards, ndim=1).detach()
    m_raw = _checks.tensor("action_mask", action_mask)
    if m_raw.ndim != 2 or m_raw.shape[0] != r.shape[0]:
        raise ValueError(
            f"action_mask must have shape (B, T) with B={r.shape[0]} matching rewards, "
            f"got {tuple(m_raw.shape)}"
        )
    beta = _checks.positive("kl_coef", kl_coef, allow_zero=True)
    m = m_raw.to(r.dtype)
    out = torch.zeros_like(m)
    if kl is not None and beta > 0:
        k = _checks.floating("kl", kl)
        _checks.same_shape("action_mask", m, kl=k)
        out = out - beta * torch.where(m > 0, k.detach().to(r.dtype), torch.zeros_like(out))
    if token_rewards is not None:
        extra = _checks.floating("token_rewards", token_rewards)
        _checks.same_shape("action_mask", m, token_rewards=extra)
        out = out + torch.where(m > 0, extra.detach().to(r.dtype), torch.zeros_like(out))
    last = last_action_index(m)
    has_action = last >= 0
    rows = torch.arange(r.shape[0], device=r.device)[has_action]
    out[rows, last[has_action]] += r[has_action]
    return out


def overlong_penalty(
    *,
    response_lengths: Tensor,
    max_new_tokens: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """DAPO's soft overlong punishment, to be added to the scalar reward.

    L_exp = max_new_tokens − buffer_len; e = min(len − L_exp, buffer_len);
    penalty = −(e / buffer_len)·penalty_factor where e > 0, else 0.
    Example: max_new 100, buffer 20, factor 1: len 80 → 0, len 90 → −0.5, len 110 → −1.0.

    Args:
        response_lengths: (B,) number of generated tokens per sample.
        max_new_tokens: Generation budget per sample.
        buffer_len: Length of the punishment interval, 0 < buffer_len <= max_new_tokens.
        penalty_factor: Penalty at (and beyond) the budget, >= 0.

    Returns:
        (B,) float32 penalties (<= 0).
    """
    lengths = _checks.tensor("response_lengths", response_lengths)
    if lengths.ndim != 1:
        raise ValueError(f"response_lengths must have shape (B,), got {tuple(lengths.shape)}")
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(
            f"buffer_len must satisfy 0 < buffer_len <= max_new_tokens={max_new_tokens}, "
            f"got {buffer_len}"
        )
    factor = _checks.positive("penalty_factor", penalty_factor, allow_zero=True)
    expected = max_new_tokens - buffer_len
    excess = (lengths.to(torch.float32) - expected).clamp(max=float(buffer_len))
    return torch.where(excess > 0, -excess / buffer_len * factor, torch.zeros_like(excess))


def stop_properly_penalty(rewards: Tensor, *, truncated: Tensor, coef: float) -> Tensor:
    """Penalise samples that hit the length limit instead of stopping.

    For truncated samples: coef in [0, 1] scales the reward (r ← coef·r); coef < 0 replaces it
    (r ← coef). Samples that stopped properly keep their reward.

    Args:
        rewards: (B,) float.
        truncated: (B,) bool, True where generation ended at the length limit.
        coef: Scale in [0, 1], or a negative replacement reward.
    """
    r = _checks.floating("rewards", rewards, ndim=1)
    t = _checks.tensor("truncated", truncated)
    _checks.same_shape("rewards", r, truncated=t)
    if t.dtype != torch.bool:
        raise ValueError(f"truncated must be a bool tensor, got dtype {t.dtype}")
    if coef > 1:
        raise ValueError(f"coef must be in [0, 1] (scale) or negative (replacement), got {coef}")
    penalised = r * coef if coef >= 0 else torch.full_like(r, coef)
    return torch.where(t.bool(), penalised, r)


def overlong_filter_mask(action_mask: Tensor, *, truncated: Tensor) -> Tensor:
    """DAPO overlong filtering: truncated samples leave the loss entirely.

    Args:
        action_mask: (B, T).
        truncated: (B,) bool.

    Returns:
        (B, T) mask of ``action_mask``'s dtype with the rows of truncated samples zeroed.
    """
    m = _checks.tensor("action_mask", action_mask)
    t = _checks.tensor("truncated", truncated)
    if t.dtype != torch.bool:
        raise ValueError(f"truncated must be a bool tensor, got dtype {t.dtype}")
    if m.ndim != 2 or t.shape != (m.shape[0],):
        raise ValueError(
            f"truncated must have shape (B,)=({m.shape[0]},) for action_mask of shape "
            f"{tuple(m.shape)}, got {tuple(t.shape)}"
        )
    return m * (~t.bool()).unsqueeze(1).to(m.dtype)
