"""Masked reductions, whitening across a split batch, and float64 gradchecks of smooth losses."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algos import (
    WhitenStats,
    clipped_value_loss,
    dpo_loss,
    masked_mean,
    masked_sum,
    masked_whiten,
    reward_model_loss,
    whiten_stats,
)

F64 = torch.float64


def test_masked_mean_of_empty_rows_is_zero() -> None:
    values = torch.tensor([[1.0, 3.0], [5.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [0, 0]])
    torch.testing.assert_close(
        masked_mean(values, mask, dim=1), torch.tensor([2.0, 0.0], dtype=F64)
    )
    assert masked_sum(values, torch.zeros(2, 2)).item() == 0.0


def test_whiten_without_mean_shift_keeps_the_mean() -> None:
    # x = [1, 3]: μ = 2, σ = 1 → (x − μ)/σ + μ = [1, 3].
    x = torch.tensor([[1.0, 3.0]], dtype=F64)
    torch.testing.assert_close(masked_whiten(x, torch.ones(1, 2), shift_mean=False), x)


@settings(max_examples=40, deadline=None)
@given(split=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_whitening_a_split_batch_with_summed_stats_equals_the_full_batch(split, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(6, 4, generator=gen, dtype=F64) * 3 + 1
    mask = (torch.rand(6, 4, generator=gen) > 0.3).to(F64)
    full = masked_whiten(values, mask)
    parts = [(values[:split], mask[:split]), (values[split:], mask[split:])]
    local = [whiten_stats(v, m) for v, m in parts]
    # What an all-reduce (sum) of each field across the two "ranks" produces.
    summed = WhitenStats(
        *(sum(getattr(s, f.name) for s in local) for f in dataclasses.fields(WhitenStats))
    )
    pieces = [masked_whiten(v, m, stats=summed) for v, m in parts]
    torch.testing.assert_close(torch.cat(pieces), full)


def test_whitening_a_constant_is_finite() -> None:
    out = masked_whiten(torch.full((2, 3), 4.0, dtype=F64), torch.ones(2, 3))
    assert torch.isfinite(out).all()
    assert (out == 0).all()


def test_value_loss_gradcheck_and_unclipped_form() -> None:
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(2, 3, generator=gen, dtype=F64)
    returns = torch.randn(2, 3, generator=gen, dtype=F64)
    values = (old + 0.5 * torch.randn(2, 3, generator=gen, dtype=F64)).requires_grad_()
    mask = torch.ones(2, 3)

    def f(v):
        return clipped_value_loss(
            values=v, old_values=old, returns=returns, action_mask=mask, clip_eps=0.2
        )[0]

    assert torch.autograd.gradcheck(f, (values,))
    plain, metrics = clipped_value_loss(
        values=values, old_values=old, returns=returns, action_mask=mask, clip_eps=None
    )
    torch.testing.assert_close(plain, 0.5 * (values - returns) ** 2)
    assert metrics["critic/clip_frac"].item() == 0.0


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_gradcheck(loss_type) -> None:
    gen = torch.Generator().manual_seed(1)
    chosen, rejected = (
        torch.randn(4, generator=gen, dtype=F64, requires_grad=True) for _ in range(2)
    )
    ref_c, ref_r = (
        torch.randn(4, generator=gen, dtype=F64),
        torch.randn(4, generator=gen, dtype=F64),
    )

    def f(c, r):
        return dpo_loss(
            chosen_logps=c,
            rejected_logps=r,
            ref_chosen_logps=ref_c,
            ref_rejected_logps=ref_r,
            loss_type=loss_type,
            label_smoothing=0.1 if loss_type == "sigmoid" else 0.0,
        )[0]

    assert torch.autograd.gradcheck(f, (chosen, rejected))


def test_reward_model_gradcheck() -> None:
    gen = torch.Generator().manual_seed(2)
    chosen, rejected = (
        torch.randn(4, generator=gen, dtype=F64, requires_grad=True) for _ in range(2)
    )
    margin = torch.rand(4, generator=gen, dtype=F64)

    def f(c, r):
        return reward_model_loss(chosen_rewards=c, rejected_rewards=r, margin=margin)[0]

    assert torch.autograd.gradcheck(f, (chosen, rejected))


def test_value_loss_nan_in_masked_positions_does_not_reach_the_gradient() -> None:
    mask = torch.tensor([[1, 0]])
    nan = float("nan")
    values = torch.tensor([[1.0, nan]], dtype=F64, requires_grad=True)
    loss, _ = clipped_value_loss(
        values=values,
        old_values=torch.tensor([[0.0, nan]], dtype=F64),
        returns=torch.tensor([[2.0, nan]], dtype=F64),
        action_mask=mask,
        clip_eps=0.5,
    )
    loss.sum().backward()
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0]], dtype=F64))
