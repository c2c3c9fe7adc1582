"""KL estimators (values and gradients as losses), kl_penalty, and KL controllers."""

import math

import pytest
import torch

from rlhf.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    kl_penalty,
    make_kl_controller,
)

F64 = torch.float64


def test_registry_names() -> None:
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3", "low_var_kl"]
    assert KL_ESTIMATORS.get("low_var_kl") is KL_ESTIMATORS.get("k3")


def _categorical(seed: int = 0, v: int = 6):
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(v, generator=gen, dtype=F64, requires_grad=True)
    ref_logp = torch.log_softmax(torch.randn(v, generator=gen, dtype=F64), dim=0)
    return theta, ref_logp


def _expected_loss_grad(estimator: str, theta, ref_logp) -> torch.Tensor:
    """∇θ E_{a~π}[k(logπ(a) − logπ_ref(a))] with the sampling distribution held fixed.

    This is what a loss on sampled tokens estimates: the expectation is taken exactly here by
    weighting every action with its (detached) probability.
    """
    logp = torch.log_softmax(theta, dim=0)
    loss = (logp.exp().detach() * KL_ESTIMATORS.get(estimator)(logp - ref_logp)).sum()
    (grad,) = torch.autograd.grad(loss, theta)
    return grad


def test_k2_as_loss_has_the_gradient_of_reverse_kl() -> None:
    # E_π[x ∇logπ] = ∇ KL(π‖π_ref).
    theta, ref_logp = _categorical()
    logp = torch.log_softmax(theta, dim=0)
    (true_grad,) = torch.autograd.grad((logp.exp() * (logp - ref_logp)).sum(), theta)
    torch.testing.assert_close(_expected_loss_grad("k2", theta, ref_logp), true_grad)


def test_k3_as_loss_has_the_gradient_of_forward_kl() -> None:
    # E_π[(1 − π_ref/π) ∇logπ] = −Σ π_ref ∇logπ = ∇ KL(π_ref‖π).
    theta, ref_logp = _categorical(1)
    logp = torch.log_softmax(theta, dim=0)
    (true_grad,) = torch.autograd.grad((ref_logp.exp() * (ref_logp - logp)).sum(), theta)
    torch.testing.assert_close(_expected_loss_grad("k3", theta, ref_logp), true_grad)


def test_k1_as_loss_has_zero_expected_gradient() -> None:
    theta, ref_logp = _categorical(2)
    torch.testing.assert_close(
        _expected_loss_grad("k1", theta, ref_logp), torch.zeros(6, dtype=F64)
    )


def test_k1_and_k3_are_unbiased_for_reverse_kl() -> None:
    theta, ref_logp = _categorical(3)
    logp = torch.log_softmax(theta, dim=0).detach()
    p = logp.exp()
    true_kl = (p * (logp - ref_logp)).sum()
    for name in ("k1", "k3"):
        torch.testing.assert_close((p * KL_ESTIMATORS.get(name)(logp - ref_logp)).sum(), true_kl)


def test_k3_is_non_negative_and_finite_for_extreme_ratios() -> None:
    x = torch.tensor([-1e4, -30.0, -1.0, 0.0, 1.0, 30.0, 1e4], dtype=F64)
    out = KL_ESTIMATORS.get("k3")(x)
    assert torch.isfinite(out).all()
    assert (out >= 0).all()


def test_kl_penalty_masks_and_detaches_the_reference() -> None:
    lp = torch.tensor([[0.5, 1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[0.0, 0.0]], dtype=F64, requires_grad=True)
    out = kl_penalty(
        logprobs=lp, ref_logprobs=ref, action_mask=torch.tensor([[1, 0]]), estimator="k2"
    )
    torch.testing.assert_close(out, torch.tensor([[0.125, 0.0]], dtype=F64))
    out.sum().backward()
    assert ref.grad is None
    torch.testing.assert_close(lp.grad, torch.tensor([[0.5, 0.0]], dtype=F64))


def test_kl_penalty_errors() -> None:
    with pytest.raises(
        ValueError, match="unknown KL estimator 'k4'; choose one of: k1, k2, k3, low_var_kl"
    ):
        kl_penalty(
            logprobs=torch.zeros(1, 2),
            ref_logprobs=torch.zeros(1, 2),
            action_mask=torch.ones(1, 2),
            estimator="k4",
        )
    with pytest.raises(
        ValueError, match="ref_logprobs has shape \\(1, 3\\) but must match logprobs"
    ):
        kl_penalty(
            logprobs=torch.zeros(1, 2), ref_logprobs=torch.zeros(1, 3), action_mask=torch.ones(1, 2)
        )


def test_fixed_controller_never_moves() -> None:
    ctl = make_kl_controller(KLConfig(init_coef=0.05))
    assert isinstance(ctl, FixedKLController)
    ctl.update(10.0, 1000)
    assert ctl.value == 0.05


def test_adaptive_controller_lowers_beta_below_target_and_clips_the_error() -> None:
    ctl = make_kl_controller(
        KLConfig(init_coef=0.1, controller="adaptive", target=1.0, horizon=100)
    )
    assert isinstance(ctl, AdaptiveKLController)
    # KL = 0.5: error = −0.5 clipped to −0.2; β = 0.1·(1 − 0.2·50/100) = 0.09.
    ctl.update(0.5, 50)
    assert ctl.value == pytest.approx(0.09)


def test_controller_state_round_trips() -> None:
    ctl = AdaptiveKLController(init_coef=0.1, target=0.1, horizon=1000)
    ctl.update(0.3, 100)
    other = AdaptiveKLController(init_coef=0.5, target=0.1, horizon=1000)
    other.load_state_dict(ctl.state_dict())
    other.update(0.05, 10)
    ctl.update(0.05, 10)
    assert other.value == ctl.value


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="kl.target must be > 0 with kl.controller=adaptive"):
        KLConfig(controller="adaptive")
    with pytest.raises(ValueError, match="unknown KL controller 'pid'"):
        KLConfig(controller="pid")
    with pytest.raises(ValueError, match="kl.init_coef must be a finite number >= 0"):
        KLConfig(init_coef=-0.1)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_nan_in_masked_positions_does_not_reach_the_gradient(estimator) -> None:
    lp = torch.tensor([[0.5, float("nan")]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[0.0, float("nan")]], dtype=F64)
    out = kl_penalty(
        logprobs=lp, ref_logprobs=ref, action_mask=torch.tensor([[1, 0]]), estimator=estimator
    )
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1] == 0


def test_k3_in_float16_is_finite() -> None:
    out = kl_penalty(
        logprobs=torch.tensor([[-16.0]], dtype=torch.float16),
        ref_logprobs=torch.tensor([[-1.0]], dtype=torch.float16),
        action_mask=torch.ones(1, 1),
        estimator="k3",
    )
    # x = −15: e^15 − 1 − 15 = 3269001.37, finite in float32.
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(3269001.37, rel=1e-6)


def test_adaptive_controller_rejects_a_zero_target() -> None:
    with pytest.raises(ValueError, match="target must be > 0"):
        AdaptiveKLController(init_coef=0.1, target=0.0, horizon=10)


def test_unbiased_gradient_keeps_the_value_and_weights_the_gradient_by_hand() -> None:
    # x = logπ − logπ_ref = −1 − (−1.5) = 0.5; w = π/π_old = exp(−1 − (−1.2)) = exp(0.2).
    # Value: k3(0.5) = exp(−0.5) − 1 + 0.5; gradient w.r.t. logπ: w·x. Token 2: w = exp(4) is
    # clamped to 10, gradient 10·0.5. Token 3 is masked: value and gradient 0.
    lp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.5, -1.5]], dtype=F64)
    old = torch.tensor([[-1.2, -5.0, -1.2]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    kl = kl_penalty(logprobs=lp, ref_logprobs=ref, action_mask=mask, estimator="k3",
                    unbiased_gradient=True, old_logprobs=old)  # fmt: skip
    k3 = math.exp(-0.5) - 1 + 0.5
    torch.testing.assert_close(kl.detach(), torch.tensor([[k3, k3, 0.0]], dtype=F64))
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    torch.testing.assert_close(
        grad, torch.tensor([[math.exp(0.2) * 0.5, 10 * 0.5, 0.0]], dtype=F64)
    )
    # Without old log-probs the samples are the policy's own: w = 1.
    kl = kl_penalty(logprobs=lp, ref_logprobs=ref, action_mask=mask, estimator="k1",
                    unbiased_gradient=True)  # fmt: skip
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    torch.testing.assert_close(grad, torch.tensor([[0.5, 0.5, 0.0]], dtype=F64))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_unbiased_gradient_is_the_reverse_kl_gradient_off_policy(estimator) -> None:
    # Samples from π_old ≠ π: E_{a~π_old}[∇ loss(a)] = Σ π_old·(π/π_old)·x·∇logπ = ∇KL(π‖π_ref),
    # whatever the estimator (π_old is close enough to π that no weight reaches the clamp).
    theta, ref_logp = _categorical(3)
    logp = torch.log_softmax(theta, dim=0)
    noise = torch.randn(6, generator=torch.Generator().manual_seed(4), dtype=F64)
    old_logp = torch.log_softmax(theta.detach() + 0.3 * noise, dim=0)
    per_action = kl_penalty(
        logprobs=logp[None], ref_logprobs=ref_logp[None], action_mask=torch.ones(1, 6),
        estimator=estimator, unbiased_gradient=True, old_logprobs=old_logp[None],
    )[0]  # fmt: skip
    (grad,) = torch.autograd.grad((old_logp.exp() * per_action).sum(), theta)
    logp = torch.log_softmax(theta, dim=0)
    (true_grad,) = torch.autograd.grad((logp.exp() * (logp - ref_logp)).sum(), theta)
    torch.testing.assert_close(grad, true_grad)
