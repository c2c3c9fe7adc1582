"""DPO family, reward-model pairwise losses and the SFT loss: hand cases and exactness."""

import math

import pytest
import torch

from rlhf.algos import (
    PREFERENCE_LOSSES,
    REWARD_MODEL_LOSSES,
    dpo_loss,
    loss_normalizer,
    reward_model_loss,
    sft_loss,
)

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_registries() -> None:
    assert PREFERENCE_LOSSES.names() == ["dpo", "ipo", "sigmoid"]
    assert REWARD_MODEL_LOSSES.names() == ["log_exp", "sigmoid"]


def test_dpo_mean_over_pairs_and_metrics() -> None:
    # Pair 1: z = (−1 − −3) − (−2 − −2) = 2 → log(1 + e^−1) with β = 0.5.
    # Pair 2: z = (−4 − −2) − (−3 − −3) = −2 → log(1 + e^1).
    loss, metrics = dpo_loss(
        chosen_logps=t([-1.0, -4.0]),
        rejected_logps=t([-3.0, -2.0]),
        ref_chosen_logps=t([-2.0, -3.0]),
        ref_rejected_logps=t([-2.0, -3.0]),
        beta=0.5,
    )
    assert loss.item() == pytest.approx((softplus(-1.0) + softplus(1.0)) / 2)
    # Implicit rewards β(logπ − logπref): chosen [0.5, −0.5], rejected [−0.5, 0.5].
    assert metrics["dpo/chosen_reward"].item() == pytest.approx(0.0)
    assert metrics["dpo/accuracy"].item() == pytest.approx(0.5)
    assert metrics["dpo/margin"].item() == pytest.approx(0.0)


def test_dpo_nll_term_and_gradient_direction() -> None:
    chosen = t([-5.0]).requires_grad_()
    rejected = t([-5.0]).requires_grad_()
    loss, metrics = dpo_loss(
        chosen_logps=chosen,
        rejected_logps=rejected,
        ref_chosen_logps=t([-5.0]),
        ref_rejected_logps=t([-5.0]),
        beta=0.1,
        chosen_nll=t([2.0]),
        nll_coef=0.5,
    )
    # z = 0: log 2 + 0.5·2.
    assert loss.item() == pytest.approx(math.log(2) + 1.0)
    assert metrics["dpo/nll"].item() == pytest.approx(2.0)
    loss.backward()
    # ∂/∂logπ_c = −β·σ(−βz) = −0.05; the rejected side gets the opposite sign.
    assert chosen.grad.item() == pytest.approx(-0.05)
    assert rejected.grad.item() == pytest.approx(0.05)


def test_dpo_global_normalizer_makes_shards_add_up() -> None:
    gen = torch.Generator().manual_seed(0)
    cols = [torch.randn(6, generator=gen, dtype=F64) for _ in range(4)]
    full, _ = dpo_loss(
        chosen_logps=cols[0],
        rejected_logps=cols[1],
        ref_chosen_logps=cols[2],
        ref_rejected_logps=cols[3],
    )
    shards = [
        dpo_loss(
            chosen_logps=cols[0][s],
            rejected_logps=cols[1][s],
            ref_chosen_logps=cols[2][s],
            ref_rejected_logps=cols[3][s],
            normalizer=6,
        )[0]
        for s in (slice(0, 1), slice(1, 6))
    ]
    torch.testing.assert_close(sum(shards), full)


def test_dpo_errors() -> None:
    ok = {
        "chosen_logps": t([0.0]),
        "rejected_logps": t([0.0]),
        "ref_chosen_logps": t([0.0]),
        "ref_rejected_logps": t([0.0]),
    }
    with pytest.raises(
        ValueError, match="rejected_logps has shape \\(2,\\) but must match chosen_logps"
    ):
        dpo_loss(**{**ok, "rejected_logps": t([0.0, 1.0])})
    with pytest.raises(ValueError, match="label_smoothing applies to the sigmoid"):
        dpo_loss(**ok, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="unknown preference loss 'kto'"):
        dpo_loss(**ok, loss_type="kto")
    with pytest.raises(ValueError, match="chosen_nll is required when nll_coef > 0"):
        dpo_loss(**ok, nll_coef=1.0)
    with pytest.raises(ValueError, match="beta must be a finite number > 0"):
        dpo_loss(**ok, beta=0.0)


def test_reward_model_losses_with_margin() -> None:
    # r_c − r_r = [2, −1], margin [1, 0]: −logσ(1) = softplus(−1), −logσ(−1) = softplus(1).
    loss, metrics = reward_model_loss(
        chosen_rewards=t([3.0, 0.0]), rejected_rewards=t([1.0, 1.0]), margin=t([1.0, 0.0])
    )
    assert loss.item() == pytest.approx((softplus(-1.0) + softplus(1.0)) / 2)
    assert metrics["rm/accuracy"].item() == pytest.approx(0.5)
    log_exp, _ = reward_model_loss(
        chosen_rewards=t([3.0, 0.0]),
        rejected_rewards=t([1.0, 1.0]),
        margin=t([1.0, 0.0]),
        loss_type="log_exp",
    )
    torch.testing.assert_close(log_exp, loss)


def test_reward_model_log_exp_is_stable_for_large_gaps() -> None:
    loss, _ = reward_model_loss(
        chosen_rewards=t([-500.0]), rejected_rewards=t([500.0]), loss_type="log_exp"
    )
    assert loss.item() == pytest.approx(1000.0)


def test_sft_token_mean_and_exact_global_normalizer() -> None:
    logprobs = t([[-1.0, -2.0, -9.0], [-3.0, -4.0, -5.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    loss, metrics = sft_loss(logprobs=logprobs, loss_mask=mask)
    assert loss.item() == pytest.approx((1 + 2 + 3) / 3)
    assert metrics["sft/tokens"].item() == 3
    norm = loss_normalizer(mask, mode="token-mean")
    shards = [
        sft_loss(logprobs=logprobs[i : i + 1], loss_mask=mask[i : i + 1], normalizer=norm)[0]
        for i in range(2)
    ]
    torch.testing.assert_close(sum(shards), loss)


def test_sft_errors() -> None:
    with pytest.raises(ValueError, match="loss_mask has shape \\(2, 2\\) but must match logprobs"):
        sft_loss(logprobs=torch.zeros(2, 3), loss_mask=torch.ones(2, 2))
