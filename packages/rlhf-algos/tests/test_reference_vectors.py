"""Reference vectors for the estimators and losses, to 1e-6.

The expected numbers were computed independently in float64; the derivations are repeated in
comments so a reader can check them by hand.
"""

import math

import pytest
import torch

from rlhf.algos import (
    GROUP_BASELINES,
    KL_ESTIMATORS,
    AdaptiveKLController,
    AdvantageConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    aggregate_loss,
    clipped_value_loss,
    compute_advantages,
    discounted_returns,
    dpo_loss,
    entropy_from_logits,
    gae,
    masked_whiten,
    overlong_penalty,
    rollout_correction_weights,
    shape_token_rewards,
)
from rlhf.algos.policy import POLICY_LOSSES

F64 = torch.float64
TOL = {"atol": 1e-6, "rtol": 0.0}


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


REWARDS = t([[1, 0, 0, 1], [0, 0, 0, 1]]).reshape(-1)


def test_rloo_vector() -> None:
    # Group 1: each 1 sees others' mean 1/3 → 2/3; each 0 sees 2/3 → −2/3.
    # Group 2: each 0 sees 1/3 → −1/3; the 1 sees 0 → 1.
    out = GROUP_BASELINES.get("leave_one_out")(REWARDS, n_samples_per_prompt=4)
    expected = t(
        [[0.666667, -0.666667, -0.666667, 0.666667], [-0.333333, -0.333333, -0.333333, 1.0]]
    )
    torch.testing.assert_close(out.view(2, 4), expected, atol=1e-6, rtol=0)


def test_mean_subtracted_vector() -> None:
    out = GROUP_BASELINES.get("mean")(REWARDS, n_samples_per_prompt=4)
    torch.testing.assert_close(
        out.view(2, 4), t([[0.5, -0.5, -0.5, 0.5], [-0.25, -0.25, -0.25, 0.75]]), **TOL
    )


def test_group_norm_vector() -> None:
    # Unbiased std: sqrt(4·0.25/3) = 0.57735 and sqrt((3·0.0625 + 0.5625)/3) = 0.5.
    out = GROUP_BASELINES.get("group_norm")(REWARDS, n_samples_per_prompt=4)
    expected = t([[0.866025, -0.866025, -0.866025, 0.866025], [-0.5, -0.5, -0.5, 1.5]])
    torch.testing.assert_close(out.view(2, 4), expected, **TOL)


def test_gae_vector() -> None:
    # δ = [0.1, 0.1, 0.1, 0.2]; A_3 = 0.2, A_2 = 0.1 + 0.95·0.2 = 0.29,
    # A_1 = 0.1 + 0.95·0.29 = 0.3755, A_0 = 0.1 + 0.95·0.3755 = 0.456725.
    adv, ret = gae(
        t([[0, 0, 0, 1]]), t([[0.5, 0.6, 0.7, 0.8]]), torch.ones(1, 4), gamma=1.0, lam=0.95
    )
    torch.testing.assert_close(adv, t([[0.456725, 0.3755, 0.29, 0.2]]), **TOL)
    torch.testing.assert_close(ret, t([[0.956725, 0.9755, 0.99, 1.0]]), **TOL)


def test_returns_with_kl_in_reward_vector() -> None:
    # r = −0.1·kl + R·1[last]: [−0.02, 0.01, −0.03, 0.995]; G is the reverse cumulative sum.
    mask = torch.ones(1, 4)
    r = shape_token_rewards(
        rewards=t([1.0]), action_mask=mask, kl=t([[0.2, -0.1, 0.3, 0.05]]), kl_coef=0.1
    )
    torch.testing.assert_close(r, t([[-0.02, 0.01, -0.03, 0.995]]), **TOL)
    g = discounted_returns(r, mask, gamma=1.0)
    torch.testing.assert_close(g, t([[0.955, 0.975, 0.965, 0.995]]), **TOL)


def test_returns_with_kl_through_the_estimator() -> None:
    out = compute_advantages(
        config=AdvantageConfig(estimator="reinforce", whiten=False, reward_clip=None),
        rewards=t([1.0]),
        action_mask=torch.ones(1, 4),
        kl=t([[0.2, -0.1, 0.3, 0.05]]),
        kl_coef=0.1,
    )
    torch.testing.assert_close(out.returns, t([[0.955, 0.975, 0.965, 0.995]]), **TOL)


def test_whitening_vector() -> None:
    # μ = 4/3, σ² = ((1/3)²·2 + (2/3)²)/3 = 2/9; (1 − 4/3)/sqrt(2/9) = −0.707107.
    values = t([[1.0, 1.0, 99.0], [2.0, -7.0, 5.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    out = masked_whiten(values, mask)
    torch.testing.assert_close(out, t([[-0.707107, -0.707107, 0.0], [1.414214, 0.0, 0.0]]), **TOL)


PPO_ADV = t([1, 1, -1, -1, -1])
PPO_RATIO = t([1.5, 0.5, 1.5, 0.5, 5.0])


def _ppo(config: PolicyLossConfig) -> torch.Tensor:
    loss, _ = POLICY_LOSSES.get("ppo")(
        logprobs=PPO_RATIO.log().unsqueeze(0),
        old_logprobs=torch.zeros(1, 5, dtype=F64),
        advantages=PPO_ADV.unsqueeze(0),
        action_mask=torch.ones(1, 5),
        config=config,
    )
    return loss.squeeze(0)


def test_ppo_clip_vector() -> None:
    torch.testing.assert_close(_ppo(PolicyLossConfig()), t([-1.2, -0.5, 1.5, 0.8, 5.0]), **TOL)


def test_dual_clip_vector() -> None:
    # Only the A < 0 token with ρ = 5 is bounded: −max(−5, 3·(−1)) = 3.
    out = _ppo(PolicyLossConfig(dual_clip=3.0))
    torch.testing.assert_close(out, t([-1.2, -0.5, 1.5, 0.8, 3.0]), **TOL)


DELTA = t([[0.0, 1.0, -0.9]])


def _weights(level: str, mode: str) -> torch.Tensor:
    w, _ = rollout_correction_weights(
        old_logprobs=DELTA,
        rollout_logprobs=torch.zeros_like(DELTA),
        action_mask=torch.ones(1, 3),
        config=RolloutCorrectionConfig(level=level, mode=mode, threshold=(0.5, 5.0)),
    )
    return w


def test_tis_vector() -> None:
    torch.testing.assert_close(_weights("token", "truncate"), t([[1.0, 2.718282, 0.5]]), **TOL)


def test_icepop_vector() -> None:
    torch.testing.assert_close(_weights("token", "mask"), t([[1.0, 2.718282, 0.0]]), **TOL)


def test_geometric_mask_vector() -> None:
    # exp(mean δ) = exp(0.1/3) = 1.033895 is inside [0.5, 5]: the sequence keeps w = exp(δ).
    assert math.exp(0.1 / 3) == pytest.approx(1.033895, abs=1e-6)
    torch.testing.assert_close(_weights("geometric", "mask"), t([[1.0, 2.718282, 0.40657]]), **TOL)


def test_value_loss_vector() -> None:
    # Token 0: V_clip = 0.5, max((0.5 − 2)², (1 − 2)²) = 2.25 → 1.125. Token 1: 0.5·1 = 0.5.
    loss, _ = clipped_value_loss(
        values=t([[1.0, 0.0]]),
        old_values=t([[0.0, 0.0]]),
        returns=t([[2.0, 1.0]]),
        action_mask=torch.ones(1, 2),
        clip_eps=0.5,
    )
    torch.testing.assert_close(loss, t([[1.125, 0.5]]), **TOL)


def test_kl_estimator_vector() -> None:
    x = t([0.5])
    torch.testing.assert_close(KL_ESTIMATORS.get("k1")(x), t([0.5]), **TOL)
    torch.testing.assert_close(KL_ESTIMATORS.get("k2")(x), t([0.125]), **TOL)
    # k3 = e^−0.5 − 1 + 0.5 = 0.606531 − 0.5.
    torch.testing.assert_close(KL_ESTIMATORS.get("k3")(x), t([0.106531]), **TOL)
    torch.testing.assert_close(KL_ESTIMATORS.get("low_var_kl")(x), t([0.106531]), **TOL)


def test_adaptive_kl_vector() -> None:
    # error = clip(0.2/0.1 − 1, −0.2, 0.2) = 0.2; β = 0.01·(1 + 0.2·1024/10000).
    ctl = AdaptiveKLController(init_coef=0.01, target=0.1, horizon=10000)
    ctl.update(0.2, 1024)
    assert ctl.value == pytest.approx(0.0102048, abs=1e-9)


def test_entropy_vector() -> None:
    # lse = 3 + log(1 + e^−1 + e^−2) = 3.407606; Σ p·z = 2.575210; H = 0.832396.
    out = entropy_from_logits(t([[1.0, 2.0, 3.0]]))
    assert out.item() == pytest.approx(0.832396, abs=1e-6)


def test_aggregation_vector() -> None:
    loss = t([[1, 2, 0], [3, 4, 5]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    assert aggregate_loss(loss, mask, mode="token-mean").item() == pytest.approx(3.0, abs=1e-6)
    # (1.5 + 4) / 2.
    assert aggregate_loss(loss, mask, mode="seq-mean-token-mean").item() == pytest.approx(
        2.75, abs=1e-6
    )


@pytest.mark.parametrize(("length", "expected"), [(80, 0.0), (90, -0.5), (110, -1.0)])
def test_overlong_penalty_vector(length: int, expected: float) -> None:
    out = overlong_penalty(
        response_lengths=torch.tensor([length]),
        max_new_tokens=100,
        buffer_len=20,
        penalty_factor=1.0,
    )
    assert out.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    ("loss_type", "smoothing", "expected"),
    [("sigmoid", 0.0, 0.598139), ("sigmoid", 0.1, 0.618139), ("ipo", 0.0, 9.0)],
)
def test_dpo_vectors(loss_type: str, smoothing: float, expected: float) -> None:
    # z = (−10 + 12) − (−11 + 11) = 2; DPO: log(1 + e^−0.2); IPO: (2 − 1/0.2)² = 9.
    loss, _ = dpo_loss(
        chosen_logps=t([-10.0]),
        rejected_logps=t([-12.0]),
        ref_chosen_logps=t([-11.0]),
        ref_rejected_logps=t([-11.0]),
        beta=0.1,
        loss_type=loss_type,
        label_smoothing=smoothing,
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)
