"""Masked reductions and global masked whitening.

A fully masked row or batch never yields NaN: its sum is 0 and its mean is defined as 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algos import _checks

WHITEN_VAR_EPS = 1e-8


def masked_sum(values: Tensor, mask: Tensor, *, dim: int | None = None) -> Tensor:
    """Σ values·mask over ``dim`` (all elements when None).

    Args:
        values: (B, T) or any shape.
        mask: Same shape as ``values``; 1 where the element counts.
        dim: Dimension to reduce; None reduces everything to a 0-dim tensor.
    """
    _checks.floating("values", values)
    m = _checks.mask("mask", mask, like=values, like_name="values")
    # where() rather than a product so that masked NaN/inf placeholders cannot leak in.
    kept = torch.where(m > 0, values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, *, dim: int | None = None) -> Tensor:
    """Σ values·mask / Σ mask over ``dim``; 0 where the mask is empty.

    Args:
        values: (B, T) or any shape.
        mask: Same shape as ``values``.
        dim: Dimension to reduce; None for a global mean (0-dim result).
    """
    m = _checks.mask("mask", mask, like=_checks.floating("values", values), like_name="values")
    total = masked_sum(values, m, dim=dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1.0)


@dataclass(frozen=True)
class WhitenStats:
    """Sufficient statistics of a masked whitening, summable across data-parallel ranks.

    Attributes:
        total: 0-dim, Σ x·m.
        total_sq: 0-dim, Σ x²·m.
        count: 0-dim, Σ m.
    """

    total: Tensor
    total_sq: Tensor
    count: Tensor


def whiten_stats(values: Tensor, mask: Tensor) -> WhitenStats:
    """Local sums for `masked_whiten`; all-reduce (sum) each field to whiten a global batch.

    Args:
        values: (B, T) float.
        mask: (B, T).
    """
    m = _checks.mask("mask", mask, like=_checks.floating("values", values), like_name="values")
    v = values.detach().to(torch.float64)
    m64 = m.to(torch.float64)
    return WhitenStats(masked_sum(v, m64), masked_sum(v * v, m64), m64.sum())


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    scale_std: bool = True,
    stats: WhitenStats | None = None,
) -> Tensor:
    """Whitening over every valid element of the batch: (x − μ)/sqrt(max(σ², 1e-8)).

    μ = Σ(x·m)/Σm and σ² = Σ((x − μ)²·m)/Σm (population variance, as OpenRLHF and verl).
    Masked elements come out exactly 0 (OpenRLHF leaves them non-zero). The statistics are
    computed in float64 and carry no gradient.

    Args:
        values: (B, T) float.
        mask: (B, T).
        shift_mean: If False, only divide by σ (the mean is added back), as in some PPO variants.
        scale_std: If False, only subtract μ (x − μ: OpenRLHF's ``--algo.advantage.no_std_norm``).
        stats: Pre-reduced global statistics (see `whiten_stats`) for whitening a batch that is
            split across ranks; None uses this batch alone.

    Returns:
        (B, T), same dtype as ``values``.
    """
    m = _checks.mask("mask", mask, like=_checks.floating("values", values), like_name="values")
    s = stats if stats is not None else whiten_stats(values, m)
    count = s.count.clamp(min=1.0)
    mean = s.total / count
    var = (s.total_sq / count - mean * mean).clamp(min=0.0)
    scale = torch.rsqrt(var.clamp(min=WHITEN_VAR_EPS)) if scale_std else torch.ones_like(var)
    out = (values - mean.to(values.dtype)) * scale.to(values.dtype)
    if not shift_mean:
        out = out + mean.to(values.dtype)
    return torch.where(m > 0, out, torch.zeros_like(out))
