"""Policy losses (ppo, gspo, cispo), rollout correction and the composed `policy_loss`."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algos import (
    POLICY_LOSSES,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    aggregate_loss,
    policy_loss,
    rollout_correction_weights,
)

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def per_token(name: str, *, logprobs, old, adv, mask, **cfg) -> tuple[torch.Tensor, dict]:
    return POLICY_LOSSES.get(name)(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=adv,
        action_mask=mask,
        config=PolicyLossConfig(name=name, **cfg),
    )


def test_registry_holds_exactly_the_documented_losses() -> None:
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "ppo"]


def test_clip_higher_is_asymmetric() -> None:
    # ε_low = 0.2, ε_high = 0.28. A = 1, ρ = 1.5 → −min(1.5, 1.28) = −1.28.
    # A = −1, ρ = 0.5 → −min(−0.5, −0.8) = 0.8; A = −1, ρ = 1.25 → −min(−1.25, −1.25) = 1.25.
    ratio = t([[1.5, 0.5, 1.25]])
    loss, metrics = per_token(
        "ppo",
        logprobs=ratio.log(),
        old=torch.zeros(1, 3, dtype=F64),
        adv=t([[1.0, -1.0, -1.0]]),
        mask=torch.ones(1, 3),
        clip_eps_low=0.2,
        clip_eps_high=0.28,
    )
    torch.testing.assert_close(loss, t([[-1.28, 0.8, 1.25]]))
    # Clipping was active on the first two tokens only.
    assert metrics["actor/clip_ratio"].item() == pytest.approx(2 / 3)


def test_ppo_gradient_vanishes_only_where_clipped() -> None:
    # d ℓ/d logπ = −A·ρ where the unclipped term is chosen, 0 where the clipped one is.
    ratio = t([[1.5, 1.1, 0.5, 0.9]])
    lp = ratio.log().requires_grad_()
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    loss, _ = per_token(
        "ppo", logprobs=lp, old=torch.zeros(1, 4, dtype=F64), adv=adv, mask=torch.ones(1, 4)
    )
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, t([[0.0, -1.1, 0.0, 0.9]]))


def test_dual_clip_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="policy_loss.dual_clip must be > 1"):
        PolicyLossConfig(dual_clip=1.0)
    with pytest.raises(ValueError, match="dual_clip applies to 'ppo' only"):
        PolicyLossConfig(name="gspo", dual_clip=3.0)


def test_gspo_uses_the_sequence_ratio_on_every_token() -> None:
    # logπ − logπ_old = [0.1, 0.3] → s = e^0.2 = 1.221403. ε = 0.2: −min(1.2214, 1.2) = −1.2;
    # with ε_high = 0.3 the sequence is inside: −1.221403 on both tokens.
    lp, old = t([[0.1, 0.3, 5.0]]), torch.zeros(1, 3, dtype=F64)
    mask, adv = t([[1, 1, 0]]), t([[1.0, 1.0, 1.0]])
    loss, _ = per_token("gspo", logprobs=lp, old=old, adv=adv, mask=mask)
    torch.testing.assert_close(loss[:, :2], t([[-1.2, -1.2]]))
    loss, _ = per_token("gspo", logprobs=lp, old=old, adv=adv, mask=mask, clip_eps_high=0.3)
    torch.testing.assert_close(loss[:, :2], torch.full((1, 2), -math.exp(0.2), dtype=F64))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    seed=st.integers(0, 2**31 - 1),
    eps=st.floats(0.01, 0.5),
)
def test_gspo_token_form_gradient_equals_the_sequence_form(lengths, seed, eps) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, width = len(lengths), max(lengths)
    mask = (torch.arange(width).expand(b, width) < t(lengths).unsqueeze(1)).to(F64)
    old = torch.randn(b, width, generator=gen, dtype=F64) - 2
    lp = (old + 0.3 * torch.randn(b, width, generator=gen, dtype=F64)).requires_grad_()
    seq_adv = torch.randn(b, generator=gen, dtype=F64)
    adv = seq_adv.unsqueeze(1).expand(b, width)

    loss, _ = per_token(
        "gspo", logprobs=lp, old=old, adv=adv, mask=mask, clip_eps_low=eps, clip_eps_high=eps
    )
    (grad_token,) = torch.autograd.grad(aggregate_loss(loss, mask, mode="seq-mean-token-mean"), lp)

    # Sequence form of the paper: mean_i −min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(lp − old)).
    s = torch.exp(((lp - old) * mask).sum(1) / mask.sum(1))
    seq_loss = -torch.minimum(s * seq_adv, s.clamp(1 - eps, 1 + eps) * seq_adv).mean()
    (grad_seq,) = torch.autograd.grad(seq_loss, lp)
    torch.testing.assert_close(grad_token, grad_seq, atol=1e-12, rtol=1e-9)


def test_cispo_detached_weight_and_gradient() -> None:
    # ρ = [0.5, 2, 6], A = [1, −1, 1], weight clip [0, 4] → w = [0.5, 2, 4];
    # ℓ = −w·A·logπ = [0.346574, 1.386294, −7.167038]; ∂ℓ/∂logπ = −w·A = [−0.5, 2, −4].
    lp = t([[math.log(0.5), math.log(2.0), math.log(6.0)]]).requires_grad_()
    loss, metrics = per_token(
        "cispo",
        logprobs=lp,
        old=torch.zeros(1, 3, dtype=F64),
        adv=t([[1.0, -1.0, 1.0]]),
        mask=torch.ones(1, 3),
    )
    torch.testing.assert_close(
        loss.detach(), t([[0.346574, 1.386294, -7.167038]]), atol=1e-6, rtol=0
    )
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, t([[-0.5, 2.0, -4.0]]))
    assert metrics["actor/clip_ratio"].item() == pytest.approx(1 / 3)


def test_cispo_keeps_gradient_where_ppo_would_clip() -> None:
    lp = t([[math.log(1.5)]]).requires_grad_()
    loss, _ = per_token(
        "cispo",
        logprobs=lp,
        old=torch.zeros(1, 1, dtype=F64),
        adv=t([[1.0]]),
        mask=torch.ones(1, 1),
    )
    loss.sum().backward()
    assert lp.grad.item() == pytest.approx(-1.5)


@pytest.mark.parametrize(
    ("level", "mode", "expected"),
    [
        # δ = [0, 1, −0.9, (masked) 3]. Σδ = 0.1 → e^0.1 = 1.105171 inside [0.5, 5].
        ("sequence", "truncate", [1.105171, 1.105171, 1.105171, 0.0]),
        ("sequence", "mask", [1.0, 2.718282, 0.40657, 0.0]),
        # mean δ = 0.1/3 → 1.033895 (truncate keeps the statistic itself).
        ("geometric", "truncate", [1.033895, 1.033895, 1.033895, 0.0]),
        ("token", "truncate", [1.0, 2.718282, 0.5, 0.0]),
    ],
)
def test_correction_levels_and_modes(level, mode, expected) -> None:
    w, _ = rollout_correction_weights(
        old_logprobs=t([[0.0, 1.0, -0.9, 3.0]]),
        rollout_logprobs=torch.zeros(1, 4, dtype=F64),
        action_mask=t([[1, 1, 1, 0]]),
        config=RolloutCorrectionConfig(level=level, mode=mode),
    )
    torch.testing.assert_close(w, t([expected]), atol=1e-6, rtol=0)


def test_sequence_mask_drops_a_whole_sequence_outside_the_threshold() -> None:
    # Σδ = 2 → e^2 = 7.39 > 5: every token of row 0 gets weight 0; row 1 (δ = 0) keeps 1.
    w, metrics = rollout_correction_weights(
        old_logprobs=t([[1.0, 1.0], [0.0, 0.0]]),
        rollout_logprobs=torch.zeros(2, 2, dtype=F64),
        action_mask=torch.ones(2, 2),
        config=RolloutCorrectionConfig(level="sequence", mode="mask"),
    )
    torch.testing.assert_close(w, t([[0.0, 0.0], [1.0, 1.0]]))
    assert metrics["rollout_correction/outside_frac"].item() == pytest.approx(0.5)


# Divergence gates at p = π_rollout(y_t), q = π_old(y_t) for three tokens:
#   (p, q) = (0.2, 0.3), (0.5, 0.5), (0.9, 0.6); w = q/p = [1.5, 1, 2/3].
#   binary_kl = 0.2·ln(2/3) + 0.8·ln(8/7) = −0.0810930 + 0.1068251 = 0.0257321;
#               0; 0.9·ln 1.5 + 0.1·ln 0.25 = 0.3649186 − 0.1386294 = 0.2262892.
#   tv = 0.1, 0, 0.3. Sequence means: binary_kl 0.0840071, tv 0.1333333.
GATE_P = [0.2, 0.5, 0.9]
GATE_Q = [0.3, 0.5, 0.6]


@pytest.mark.parametrize(
    ("gating", "level", "high", "expected"),
    [
        ("binary_kl", "token", 0.05, [1.5, 1.0, 0.0]),  # 0.2263 > 0.05: token 3 masked
        ("binary_kl", "token", 0.02, [0.0, 1.0, 0.0]),  # 0.0257 > 0.02 too
        ("tv", "token", 0.2, [1.5, 1.0, 0.0]),
        ("tv", "token", 0.05, [0.0, 1.0, 0.0]),
        ("binary_kl", "geometric", 0.1, [1.5, 1.0, 2 / 3]),  # mean 0.0840 inside: all kept
        ("binary_kl", "geometric", 0.08, [0.0, 0.0, 0.0]),  # mean 0.0840 outside: all dropped
        ("tv", "geometric", 0.14, [1.5, 1.0, 2 / 3]),  # mean 0.1333
        ("tv", "geometric", 0.13, [0.0, 0.0, 0.0]),
    ],
)
def test_divergence_gates_mask_by_their_upper_bound(gating, level, high, expected) -> None:
    w, metrics = rollout_correction_weights(
        old_logprobs=t([[math.log(q) for q in GATE_Q] + [0.0]]),
        rollout_logprobs=t([[math.log(p) for p in GATE_P] + [-5.0]]),
        action_mask=t([[1, 1, 1, 0]]),  # the masked token's divergence counts nowhere
        config=RolloutCorrectionConfig(
            level=level, mode="mask", threshold=(0.0, high), gating=gating
        ),
    )
    torch.testing.assert_close(w, t([[*expected, 0.0]]), atol=1e-6, rtol=0)
    dropped = sum(1 for e in expected if e == 0.0)
    assert metrics["rollout_correction/outside_frac"].item() == pytest.approx(dropped / 3)


@pytest.mark.parametrize("gating", ["binary_kl", "tv"])
def test_a_divergence_gate_keeps_tokens_where_the_policies_agree(gating) -> None:
    """Learner and sampler agreeing to 1e-6 in log-prob (a synchronous float32 run): every
    divergence is ~1e-12 or 0, far below the bound, so nothing is masked. (binary_kl's two
    terms cancel in float32 to a few ulps either side of 0; below the gate's lower bound 0
    they masked 37 % of these tokens.)"""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 16, generator=gen) * 3
    rollout = old + (torch.rand(8, 16, generator=gen) - 0.5) * 2e-6
    w, metrics = rollout_correction_weights(
        old_logprobs=old,
        rollout_logprobs=rollout,
        action_mask=torch.ones(8, 16),
        config=RolloutCorrectionConfig(mode="mask", threshold=(0.0, 1e-3), gating=gating),
    )
    assert metrics["rollout_correction/outside_frac"].item() == 0.0
    torch.testing.assert_close(w, torch.exp(old - rollout))


def test_the_divergences_match_their_formulas() -> None:
    from rlhf.algos import CORRECTION_DIVERGENCES

    p, q = t([GATE_P]), t([GATE_Q])
    torch.testing.assert_close(
        CORRECTION_DIVERGENCES.get("binary_kl")(p, q),
        t([[0.0257321, 0.0, 0.2262892]]),
        atol=1e-7,
        rtol=0,
    )
    torch.testing.assert_close(
        CORRECTION_DIVERGENCES.get("tv")(p, q), t([[0.1, 0.0, 0.3]]), atol=1e-12, rtol=0
    )


def test_a_divergence_gate_needs_mask_an_upper_bound_and_a_per_token_statistic() -> None:
    with pytest.raises(ValueError, match=r"gating binary_kl needs mode mask \(not truncate\)"):
        RolloutCorrectionConfig(gating="binary_kl", threshold=(0.0, 0.1))
    with pytest.raises(
        ValueError, match=r"an upper bound only: threshold \(0, HIGH\), not \(0\.5, 5\.0\)"
    ):
        RolloutCorrectionConfig(gating="tv", mode="mask")
    with pytest.raises(ValueError, match="level token or geometric"):
        RolloutCorrectionConfig(gating="tv", mode="mask", level="sequence", threshold=(0.0, 0.1))
    with pytest.raises(ValueError, match="unknown rollout correction gating 'kl'"):
        RolloutCorrectionConfig(gating="kl", mode="mask", threshold=(0.0, 0.1))


def test_correction_config_errors() -> None:
    with pytest.raises(
        ValueError,
        match="unknown rollout correction level 'tokens'; choose one of: geometric, sequence, token",
    ):
        RolloutCorrectionConfig(level="tokens")
    with pytest.raises(ValueError, match="rollout_correction.mode 'clip' is unknown"):
        RolloutCorrectionConfig(mode="clip")
    with pytest.raises(ValueError, match="rollout_correction.threshold must satisfy low < high"):
        RolloutCorrectionConfig(threshold=(2.0, 1.0))


def test_policy_loss_composes_loss_weights_and_aggregation() -> None:
    # PPO vector tokens 0 and 1 (ℓ = [−1.2, −0.5]) with token-TIS weights [1, 2.718282] → token mean.
    lp = t([[math.log(1.5), math.log(0.5), 0.0]])
    old = torch.zeros(1, 3, dtype=F64)
    rollout = t([[0.0, -1.0, 0.0]])
    loss, metrics = policy_loss(
        logprobs=lp,
        old_logprobs=old,
        advantages=t([[1.0, 1.0, 1.0]]),
        action_mask=t([[1, 1, 0]]),
        config=PolicyLossConfig(),
        rollout_logprobs=rollout,
        rollout_correction=RolloutCorrectionConfig(),
    )
    assert loss.item() == pytest.approx((-1.2 - 0.5 * math.e) / 2, abs=1e-9)
    assert metrics["actor/pg_loss"].item() == pytest.approx(loss.item())
    assert not metrics["actor/pg_loss"].requires_grad


def test_policy_loss_errors_name_the_argument() -> None:
    ok = {
        "logprobs": torch.zeros(2, 3),
        "old_logprobs": torch.zeros(2, 3),
        "advantages": torch.zeros(2, 3),
    }
    with pytest.raises(ValueError, match="advantages has shape \\(2, 2\\) but must match logprobs"):
        policy_loss(
            **{**ok, "advantages": torch.zeros(2, 2)},
            action_mask=torch.ones(2, 3),
            config=PolicyLossConfig(),
        )
    with pytest.raises(
        ValueError, match="action_mask has shape \\(3, 2\\) but must match logprobs"
    ):
        policy_loss(**ok, action_mask=torch.ones(3, 2), config=PolicyLossConfig())
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        policy_loss(
            **ok, action_mask=torch.ones(2, 3), config=PolicyLossConfig(), aggregation="mean"
        )
    with pytest.raises(ValueError, match="rollout_logprobs are required"):
        policy_loss(
            **ok,
            action_mask=torch.ones(2, 3),
            config=PolicyLossConfig(),
            rollout_correction=RolloutCorrectionConfig(),
        )
    with pytest.raises(
        ValueError, match="unknown policy loss 'grpo'; choose one of: cispo, gspo, ppo"
    ):
        PolicyLossConfig(name="grpo")
    with pytest.raises(ValueError, match="logprobs must be a floating-point tensor"):
        policy_loss(
            **{**ok, "logprobs": torch.zeros(2, 3, dtype=torch.long)},
            action_mask=torch.ones(2, 3),
            config=PolicyLossConfig(),
        )


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_fully_masked_batch_gives_zero_loss_and_finite_gradient(name) -> None:
    lp = torch.randn(2, 3, dtype=F64).requires_grad_()
    loss, metrics = policy_loss(
        logprobs=lp,
        old_logprobs=torch.randn(2, 3, dtype=F64),
        advantages=torch.randn(2, 3, dtype=F64),
        action_mask=torch.zeros(2, 3),
        config=PolicyLossConfig(name=name),
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())


# CISPO is left out on purpose: its detached weight makes its gradient differ from the
# derivative of its value by design; test_cispo_detached_weight_and_gradient checks it by hand.
@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_policy_losses_gradcheck_in_float64(name) -> None:
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(2, 4, generator=gen, dtype=F64)
    # Ratios away from the kinks at 1 ± ε: inside (1.05, 0.97) and beyond (1.5, 0.5) the clip
    # range, with both advantage signs, so both branches of the surrogate are probed.
    ratios = t([[1.05, 1.5, 0.5, 0.97], [1.5, 0.5, 1.02, 1.0]])
    lp = (old + ratios.log()).requires_grad_()
    adv = t([[1.0, 1.0, -1.0, -0.5], [-1.0, 1.0, 0.3, 2.0]])
    if name == "gspo":
        # The stop-gradient token form equals the sequence objective's gradient only when the
        # advantage is constant over each sequence (the GSPO setting), so probe it there, with
        # a sequence ratio inside the range (row 1) and one beyond it (row 0).
        adv = adv[:, :1].expand(2, 4)
        lp = (old + t([[0.6, 0.5, 0.4, 9.0], [0.01, -0.02, 0.0, 0.0]])).requires_grad_()
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])

    def f(x: torch.Tensor) -> torch.Tensor:
        return policy_loss(
            logprobs=x,
            old_logprobs=old,
            advantages=adv,
            action_mask=mask,
            config=PolicyLossConfig(name=name),
        )[0]

    assert torch.autograd.gradcheck(f, (lp,))


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_nan_in_masked_positions_reaches_neither_loss_nor_gradient(name) -> None:
    mask = t([[1, 1, 0], [1, 0, 0]])
    nan = torch.tensor(float("nan"), dtype=F64)
    lp = torch.where(mask > 0, torch.randn(2, 3, dtype=F64) * 0.1 - 1, nan).requires_grad_()
    old = torch.where(mask > 0, torch.randn(2, 3, dtype=F64) * 0.1 - 1, nan)
    adv = torch.where(mask > 0, torch.randn(2, 3, dtype=F64), nan)
    loss, metrics = policy_loss(
        logprobs=lp,
        old_logprobs=old,
        advantages=adv,
        action_mask=mask,
        config=PolicyLossConfig(name=name),
        rollout_logprobs=old,
        rollout_correction=RolloutCorrectionConfig(level="geometric", mode="mask"),
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[mask == 0] == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_half_precision_large_log_ratio_stays_finite(name, dtype) -> None:
    # exp(15) overflows float16 (max 65504); the losses compute ratios in float32. PPO runs with
    # dual-clip: without it the true gradient for A < 0 (ρ ≈ 3.3e6) is not representable in
    # float16 at all.
    lp = torch.tensor([[-1.0, -2.0]], dtype=dtype, requires_grad=True)
    old = torch.tensor([[-16.0, -2.0]], dtype=dtype)
    config = PolicyLossConfig(name=name, dual_clip=3.0 if name == "ppo" else None)
    for a in (-1.0, 0.0, 1.0):
        loss, metrics = policy_loss(
            logprobs=lp,
            old_logprobs=old,
            advantages=torch.full((1, 2), a, dtype=dtype),
            action_mask=torch.ones(1, 2),
            config=config,
        )
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss), (a, loss)
        assert torch.isfinite(grad).all(), (a, grad)
        assert all(torch.isfinite(v) for v in metrics.values()), metrics


def test_half_precision_correction_weights_are_finite() -> None:
    w, _ = rollout_correction_weights(
        old_logprobs=torch.tensor([[15.0, 0.0]], dtype=torch.float16),
        rollout_logprobs=torch.zeros(1, 2, dtype=torch.float16),
        action_mask=torch.ones(1, 2),
        config=RolloutCorrectionConfig(mode="mask"),
    )
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0]]))
