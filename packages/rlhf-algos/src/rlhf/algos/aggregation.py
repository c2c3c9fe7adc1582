"""Loss aggregation: how a (B, T) per-token loss becomes one scalar, exactly under any split.

Every mode is written as numerator / normaliser where both are *sums* over sequences or tokens.
A learner that splits the global batch over data-parallel ranks and micro-batches computes, for
each micro-batch, `loss_normalizer` (a count), sums those counts over the whole global batch
(all ranks, all accumulation steps), and passes that sum as ``normalizer`` to `aggregate_loss`.
The micro-batch results then add up to exactly the full-batch value. A framework that averages
gradients over W ranks (DDP, DeepSpeed) or divides the loss by the number of accumulation steps
must multiply each share by that factor to undo it.

Modes (ℓ per-token loss, m mask, S the sequences with at least one valid token):

- ``token-mean``: Σ ℓm / Σ m.
- ``seq-mean-token-mean``: Σ_{s∈S} (Σ_t ℓm / Σ_t m) / |S|.
- ``seq-mean-token-sum``: Σ_{s∈S} Σ_t ℓm / |S|.
- ``seq-mean-token-sum-norm`` (Dr. GRPO, arXiv 2503.20783): Σ ℓm / (B · L_max), with B all
  sequences (empty ones included, so the normaliser is a constant) and L_max a constant.

Empty sequences are excluded from |S| (as verl does), so a fully masked sequence contributes 0
and never a NaN. A sequence is a row: unpack padding-free packed batches (several samples in one
row) into rows before aggregating, or the ``seq-mean-*`` modes count a packed row as one
sequence. Half-precision losses are summed in float32 and normalisers are float64 counts, so the
result stays exact for any token count; the share is returned in float32 for half inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algos import _checks
from rlhf.algos.registry import Registry


@dataclass(frozen=True)
class Aggregation:
    """One aggregation mode as a (numerator, normaliser) pair of sums.

    Attributes:
        numerator: fn(loss (B, T), mask (B, T)) -> 0-dim differentiable sum.
        normalizer: fn(mask (B, T), max_len: int | None) -> 0-dim count (no gradient).
    """

    numerator: Callable[[Tensor, Tensor], Tensor]
    normalizer: Callable[[Tensor, int | None], Tensor]


AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


def _masked(loss: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask > 0, loss, torch.zeros_like(loss))


def _nonempty(mask: Tensor) -> Tensor:
    return (mask.sum(dim=1) > 0).to(mask.dtype)


def _seq_token_mean(loss: Tensor, mask: Tensor) -> Tensor:
    per_seq = _masked(loss, mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return per_seq.sum()


def _require_max_len(mask: Tensor, max_len: int | None) -> Tensor:
    if max_len is None or max_len < 1:
        raise ValueError(
            "max_len (a constant such as the generation budget max_new_tokens) is required by "
            f"'seq-mean-token-sum-norm' and must be >= 1, got {max_len!r}"
        )
    return torch.tensor(float(mask.shape[0] * max_len), dtype=mask.dtype, device=mask.device)


AGGREGATIONS.register("token-mean")(
    Aggregation(lambda loss, mask: _masked(loss, mask).sum(), lambda mask, _: mask.sum())
)
AGGREGATIONS.register("seq-mean-token-mean")(
    Aggregation(_seq_token_mean, lambda mask, _: _nonempty(mask).sum())
)
AGGREGATIONS.register("seq-mean-token-sum")(
    Aggregation(lambda loss, mask: _masked(loss, mask).sum(), lambda mask, _: _nonempty(mask).sum())
)
AGGREGATIONS.register("seq-mean-token-sum-norm")(
    Aggregation(lambda loss, mask: _masked(loss, mask).sum(), _require_max_len)
)


def _inputs(loss: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    ell = _checks.upcast(_checks.floating("loss", loss, ndim=2))
    return ell, _checks.mask("mask", mask, like=ell, like_name="loss")


def loss_normalizer(mask: Tensor, *, mode: str, max_len: int | None = None) -> Tensor:
    """This micro-batch's contribution to the global normaliser of ``mode``.

    Sum the results over every micro-batch of the global batch (and all-reduce over ranks) and
    pass the total to `aggregate_loss`.

    Args:
        mask: (B, T), 1 where the token counts.
        mode: Name in `AGGREGATIONS`.
        max_len: L_max for ``seq-mean-token-sum-norm``.

    Returns:
        0-dim float64 tensor (an exact count), no gradient.
    """
    m = _checks.tensor("mask", mask)
    if m.ndim != 2:
        raise ValueError(f"mask must have shape (B, T), got {tuple(m.shape)}")
    agg = AGGREGATIONS.get(mode)
    return agg.normalizer((m.detach() > 0).to(torch.float64), max_len)


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    *,
    mode: str,
    normalizer: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Aggregate a per-token loss into this micro-batch's share of the global loss.

    Args:
        loss: (B, T) per-token loss.
        mask: (B, T) 0/1 validity mask (positions outside it contribute nothing, even NaN).
        mode: Name in `AGGREGATIONS`.
        normalizer: The global normaliser (sum of `loss_normalizer` over the global batch); None
            treats this batch as the whole batch. A tensor is not checked for sign or NaN (that
            would cost a device sync).
        max_len: L_max for ``seq-mean-token-sum-norm``.

    Returns:
        0-dim tensor. A zero normaliser (nothing valid anywhere) gives 0, not NaN.
    """
    ell, m = _inputs(loss, mask)
    agg = AGGREGATIONS.get(mode)
    if normalizer is None:
        normalizer = agg.normalizer(m.detach().to(torch.float64), max_len)
    elif isinstance(normalizer, bool) or not isinstance(normalizer, int | float | Tensor):
        raise ValueError(f"normalizer must be a number or a 0-dim tensor, got {normalizer!r}")
    elif isinstance(normalizer, int | float) and not (
        math.isfinite(normalizer) and normalizer >= 0
    ):
        raise ValueError(f"normalizer must be a finite non-negative count, got {normalizer!r}")
    denom = torch.as_tensor(normalizer, device=ell.device)
    if denom.ndim != 0:
        raise ValueError(f"normalizer must be a scalar, got shape {tuple(denom.shape)}")
    denom = denom.to(ell.dtype)
    num = agg.numerator(ell, m)
    # where() instead of a Python branch: no device sync on the hot path.
    return torch.where(denom > 0, num / denom.clamp(min=torch.finfo(ell.dtype).tiny), num * 0.0)
