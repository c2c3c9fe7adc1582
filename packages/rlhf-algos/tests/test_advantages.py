"""Advantage estimators: hand-derived cases per registry entry, gaps, and invariances."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algos import (
    ADVANTAGE_ESTIMATORS,
    GROUP_BASELINES,
    AdvantageConfig,
    compute_advantages,
    discounted_returns,
    gae,
    masked_whiten,
)

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def run(estimator: str, rewards, mask, *, n: int, values=None, **config) -> torch.Tensor:
    cfg = AdvantageConfig(estimator=estimator, reward_clip=None, **config)
    out = compute_advantages(
        config=cfg, rewards=t(rewards), action_mask=t(mask), n_samples_per_prompt=n, values=values
    )
    return out.advantages


def test_every_registered_estimator_has_a_hand_case_below() -> None:
    covered = {"gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "grpo", "dr_grpo",
               "flash_reinforce", "distill"}  # fmt: skip
    assert set(ADVANTAGE_ESTIMATORS.names()) == covered


def test_estimators_say_what_they_need() -> None:
    # GAE alone reads critic values; every estimator with a group baseline compares the
    # samples of a prompt (the CLI asks these instead of listing names).
    needs = {
        name: (AdvantageConfig(estimator=name).spec.needs_critic,
               AdvantageConfig(estimator=name).spec.needs_groups,
               AdvantageConfig(estimator=name).spec.needs_teacher)
        for name in ADVANTAGE_ESTIMATORS.names()
    }  # fmt: skip
    assert needs == {
        "gae": (True, False, False),
        "reinforce": (False, False, False),
        "reinforce_baseline": (False, True, False),
        "rloo": (False, True, False),
        "group_norm": (False, True, False),
        "grpo": (False, True, False),
        "dr_grpo": (False, True, False),
        "flash_reinforce": (
            False,
            False,
            False,
        ),  # one sample per prompt: the batch is the baseline
        "distill": (False, False, True),  # its token step reads a teacher's log-probs
    }
    assert AdvantageConfig(estimator="distill").spec.needs == {"logprobs", "teacher_logprobs"}


def test_distill_advantage_is_the_teacher_minus_the_student_log_prob_per_token() -> None:
    # Student log π(y_t) = [−1.5, −0.5, (feedback) −9, −1.0], teacher log π_T(y_t) =
    # [−1.0, −0.5, (feedback) 0, −2.0] → A_t = π_T − π = [0.5, 0, 0, −1.0] on action tokens,
    # each token its own (no discounting, no whitening), whatever the rewards; the reverse KL
    # sample mean over the 3 action tokens is (−0.5 + 0 + 1.0)/3 = 1/6.
    out = compute_advantages(
        config=AdvantageConfig(estimator="distill", reward_clip=None),
        rewards=t([7.0]),
        action_mask=t([[1, 1, 0, 1]]),
        logprobs=t([[-1.5, -0.5, -9.0, -1.0]]),
        teacher_logprobs=t([[-1.0, -0.5, 0.0, -2.0]]),
    )
    torch.testing.assert_close(out.advantages, t([[0.5, 0.0, 0.0, -1.0]]))
    torch.testing.assert_close(out.returns, out.advantages)
    assert out.metrics["distill/reverse_kl"].item() == pytest.approx(1 / 6)
    with pytest.raises(
        ValueError,
        match=r"teacher_logprobs \(a teacher's\) are required by the 'distill' estimator",
    ):
        compute_advantages(
            config=AdvantageConfig(estimator="distill"),
            rewards=t([1.0]),
            action_mask=t([[1, 1]]),
            logprobs=t([[-1.0, -1.0]]),
        )


def test_a_recipe_names_a_registered_token_step_and_baseline() -> None:
    from rlhf.algos import EstimatorSpec

    with pytest.raises(ValueError, match="unknown token step 'td'; choose one of: gae, returns"):
        EstimatorSpec("none", "td", whiten=False)
    with pytest.raises(ValueError, match="unknown group baseline 'median'"):
        EstimatorSpec("median", "returns", whiten=False)


def test_reinforce_discounts_per_action_token() -> None:
    # R = 2 on the last of 3 action tokens, γ = 0.5: G = [0.5, 1, 2]; position 3 is padding.
    adv = run("reinforce", [2.0], [[1, 1, 1, 0]], n=1, gamma=0.5, whiten=False)
    torch.testing.assert_close(adv, t([[0.5, 1.0, 2.0, 0.0]]))


def test_reinforce_whitens_by_default() -> None:
    # Same G as above; μ = 7/6, whitened over the 3 valid tokens.
    adv = run("reinforce", [2.0], [[1, 1, 1, 0]], n=1, gamma=0.5)
    g = t([[0.5, 1.0, 2.0, 0.0]])
    torch.testing.assert_close(adv, masked_whiten(g, t([[1, 1, 1, 0]])))
    mu = 3.5 / 3
    var = ((0.5 - mu) ** 2 + (1 - mu) ** 2 + (2 - mu) ** 2) / 3
    assert adv[0, 0].item() == pytest.approx((0.5 - mu) / math.sqrt(var), abs=1e-12)


def test_without_std_norm_whitening_only_centres() -> None:
    # OpenRLHF's --algo.advantage.no_std_norm: G = [0.5, 1, 2] minus μ = 7/6, not divided.
    adv = run("reinforce", [2.0], [[1, 1, 1, 0]], n=1, gamma=0.5, std_norm=False)
    torch.testing.assert_close(adv, t([[0.5 - 7 / 6, 1.0 - 7 / 6, 2.0 - 7 / 6, 0.0]]))
    # Group norm is a baseline, not whitening: its std stays ([3, 1] → [1, −1]).
    adv = run("group_norm", [3.0, 1.0], [[1, 1], [1, 1]], n=2, std_norm=False)
    assert adv[0, 0].item() == pytest.approx(1 / math.sqrt(2), rel=1e-6)


def test_reinforce_baseline_subtracts_group_mean_then_whitens_with_unit_gamma() -> None:
    # Group [3, 1] → [1, −1]; with γ forced to 1 every action token carries it:
    # raw = [[1, 1, 1], [−1, ·, ·]] (γ = 0.5 would give [0.25, 0.5, 1] on row 0).
    # Whitening over the 4 valid tokens: μ = 0.5, σ² = (3·0.25 + 2.25)/4 = 0.75.
    adv = run("reinforce_baseline", [3.0, 1.0], [[1, 1, 1], [1, 0, 0]], n=2, gamma=0.5)
    sigma = 0.75**0.5
    torch.testing.assert_close(adv, t([[0.5 / sigma] * 3, [-1.5 / sigma, 0.0, 0.0]]))


def test_rloo_broadcasts_to_every_action_token_with_unit_gamma() -> None:
    # Group [1, 0, 0]: 1 − 0 = 1; 0 − 1/2 = −0.5. γ = 0.5 is ignored by group estimators.
    adv = run("rloo", [1.0, 0.0, 0.0], [[1, 1], [1, 0], [0, 1]], n=3, gamma=0.5)
    torch.testing.assert_close(adv, t([[1.0, 1.0], [-0.5, 0.0], [0.0, -0.5]]))


def test_group_norm_and_its_alias() -> None:
    # Group [2, 0]: mean 1, unbiased std sqrt(2); (±1)/sqrt(2) (the 1e-9 changes nothing at 1e-7).
    for name in ("group_norm", "grpo"):
        adv = run(name, [2.0, 0.0], [[1], [1]], n=2)
        torch.testing.assert_close(
            adv, t([[1 / math.sqrt(2)], [-1 / math.sqrt(2)]]), atol=1e-8, rtol=0
        )


@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("n", [3, 5, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_identical_rewards_in_a_group_give_exactly_zero(value, n, dtype) -> None:
    # (R − mean)/std of a constant group is 0/0 → 0; in float32 the naive computation leaves a
    # rounding residue in both and returns ±sqrt((n − 1)/n).
    rewards = torch.full((n,), value, dtype=dtype)
    for name in ("group_norm", "dr_grpo", "rloo", "reinforce_baseline"):
        out = compute_advantages(
            config=AdvantageConfig(estimator=name),
            rewards=rewards,
            action_mask=torch.ones(n, 2),
            n_samples_per_prompt=n,
        )
        assert (out.advantages == 0).all(), (name, out.advantages)


def test_advantages_carry_no_gradient_even_from_a_kl_with_gradient() -> None:
    lp = torch.randn(2, 3, dtype=F64, requires_grad=True)
    out = compute_advantages(
        config=AdvantageConfig(estimator="reinforce"),
        rewards=torch.tensor([1.0, 0.0], dtype=F64, requires_grad=True),
        action_mask=torch.ones(2, 3),
        kl=lp * 2,
        kl_coef=0.1,
    )
    assert not out.advantages.requires_grad
    assert not out.returns.requires_grad
    assert not out.token_rewards.requires_grad


def test_dr_grpo_has_no_std_and_no_whitening() -> None:
    # Group [4, 0]: mean 2 → [2, −2] on every action token.
    adv = run("dr_grpo", [4.0, 0.0], [[1, 1], [1, 1]], n=2)
    torch.testing.assert_close(adv, t([[2.0, 2.0], [-2.0, -2.0]]))


def test_flash_reinforce_subtracts_the_batch_mean_without_whitening() -> None:
    # Four prompts, one sample each: R = [1, 0, 0, 0], batch mean 1/4 → [3/4, −1/4, −1/4, −1/4]
    # on every action token (γ = 1 even when set lower; no std, no whitening).
    out = compute_advantages(
        config=AdvantageConfig(estimator="flash_reinforce", reward_clip=None, gamma=0.5),
        rewards=t([1.0, 0.0, 0.0, 0.0]),
        action_mask=torch.ones(4, 2),
    )
    want = t([0.75, -0.25, -0.25, -0.25])[:, None].expand(-1, 2)
    torch.testing.assert_close(out.advantages, want)
    torch.testing.assert_close(out.returns, want)
    # Groups or not, the mean is the whole batch's: [3, 1 | 1, 1] → mean 1.5.
    adv = run("flash_reinforce", [3.0, 1.0, 1.0, 1.0], [[1], [1], [1], [1]], n=2)
    torch.testing.assert_close(adv, t([[1.5], [-0.5], [-0.5], [-0.5]]))


def test_gae_estimator_whitens_gae_advantages_and_returns_are_unwhitened() -> None:
    values = t([[0.5, 0.6, 0.7, 0.8]])
    cfg = AdvantageConfig(estimator="gae", gamma=1.0, lam=0.95, reward_clip=None)
    out = compute_advantages(
        config=cfg, rewards=t([1.0]), action_mask=torch.ones(1, 4), values=values
    )
    raw, returns = gae(t([[0, 0, 0, 1]]), values, torch.ones(1, 4), gamma=1.0, lam=0.95)
    torch.testing.assert_close(out.advantages, masked_whiten(raw, torch.ones(1, 4)))
    torch.testing.assert_close(out.returns, returns)


def test_reward_clip_applies_after_the_baseline() -> None:
    # Group [30, 0] → mean-subtracted [15, −15] → clipped to [10, −10].
    cfg = AdvantageConfig(estimator="dr_grpo", reward_clip=(-10.0, 10.0))
    out = compute_advantages(
        config=cfg, rewards=t([30.0, 0.0]), action_mask=torch.ones(2, 1), n_samples_per_prompt=2
    )
    torch.testing.assert_close(out.advantages, t([[10.0], [-10.0]]))


def test_gae_carries_value_across_environment_tokens() -> None:
    # Actions at 0, 1 and 4 (2, 3 are environment feedback). γ = 1, λ = 1, reward 1 at the end.
    # Compacted: V = [0.2, 0.4, 0.6], r = [0, 0, 1] → A = returns − V = [0.8, 0.6, 0.4].
    mask = t([[1, 1, 0, 0, 1]])
    values = t([[0.2, 0.4, 9.0, 9.0, 0.6]])
    rewards = t([[0, 0, 0, 0, 1]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, t([[0.8, 0.6, 0.0, 0.0, 0.4]]))
    torch.testing.assert_close(ret, t([[1.0, 1.0, 0.0, 0.0, 1.0]]))


def _gae_compacted(
    rewards: list[float], values: list[float], gamma: float, lam: float
) -> list[float]:
    adv, nxt_v, nxt_a = [0.0] * len(rewards), 0.0, 0.0
    for i in reversed(range(len(rewards))):
        nxt_a = rewards[i] + gamma * nxt_v - values[i] + gamma * lam * nxt_a
        nxt_v = values[i]
        adv[i] = nxt_a
    return adv


@settings(max_examples=60, deadline=None)
@given(
    mask_rows=st.lists(st.lists(st.booleans(), min_size=1, max_size=9), min_size=1, max_size=4),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_gae_with_gaps_equals_gae_on_the_compacted_action_sequence(
    mask_rows, gamma, lam, seed
) -> None:
    width = max(len(r) for r in mask_rows)
    mask = t([r + [False] * (width - len(r)) for r in mask_rows])
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(mask.shape, generator=gen, dtype=F64) * mask
    values = torch.randn(mask.shape, generator=gen, dtype=F64)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    for b in range(mask.shape[0]):
        idx = mask[b].nonzero().flatten().tolist()
        expected = _gae_compacted(rewards[b, idx].tolist(), values[b, idx].tolist(), gamma, lam)
        torch.testing.assert_close(adv[b, idx], t(expected).reshape(-1), atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(ret[b, idx], adv[b, idx] + values[b, idx])
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


@settings(max_examples=60, deadline=None)
@given(
    mask_rows=st.lists(st.lists(st.booleans(), min_size=1, max_size=9), min_size=1, max_size=4),
    gamma=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_discounted_returns_skip_gaps(mask_rows, gamma, seed) -> None:
    width = max(len(r) for r in mask_rows)
    mask = t([r + [False] * (width - len(r)) for r in mask_rows])
    rewards = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    out = discounted_returns(rewards, mask, gamma=gamma)
    for b in range(mask.shape[0]):
        idx = mask[b].nonzero().flatten().tolist()
        running, expected = 0.0, []
        for i in reversed(idx):
            running = rewards[b, i].item() + gamma * running
            expected.append(running)
        torch.testing.assert_close(out[b, idx], t(expected[::-1]).reshape(-1), atol=1e-9, rtol=1e-9)


ESTIMATORS = ["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"]


def _batch(seed: int, n: int, groups: int, width: int):
    gen = torch.Generator().manual_seed(seed)
    b = n * groups
    lengths = torch.randint(1, width + 1, (b,), generator=gen)
    mask = (torch.arange(width).expand(b, width) < lengths.unsqueeze(1)).to(F64)
    rewards = torch.randn(b, generator=gen, dtype=F64)
    values = torch.randn(b, width, generator=gen, dtype=F64)
    kl = torch.randn(b, width, generator=gen, dtype=F64) * 0.1
    return rewards, mask, values, kl


def _advantages(name, rewards, mask, values, kl, n):
    cfg = AdvantageConfig(estimator=name, gamma=0.9, lam=0.8)
    return compute_advantages(
        config=cfg,
        rewards=rewards,
        action_mask=mask,
        n_samples_per_prompt=n,
        values=values,
        kl=kl,
        kl_coef=0.05,
    )


@pytest.mark.parametrize("name", ESTIMATORS)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), pad=st.integers(1, 4))
def test_padding_and_masked_positions_do_not_change_advantages(name, seed, pad) -> None:
    n, groups, width = 3, 2, 5
    rewards, mask, values, kl = _batch(seed, n, groups, width)
    base = _advantages(name, rewards, mask, values, kl, n)
    # Extra padding columns and garbage (huge values, NaN-free) in every masked position.
    gen = torch.Generator().manual_seed(seed + 1)
    pad_mask = torch.cat([mask, torch.zeros(mask.shape[0], pad, dtype=F64)], dim=1)
    garbage = 1e6 * torch.randn(pad_mask.shape, generator=gen, dtype=F64)

    def pad_with_garbage(x: torch.Tensor) -> torch.Tensor:
        widened = torch.cat([x, torch.zeros(x.shape[0], pad, dtype=F64)], dim=1)
        return torch.where(pad_mask > 0, widened, garbage)

    padded = _advantages(name, rewards, pad_mask, pad_with_garbage(values), pad_with_garbage(kl), n)
    torch.testing.assert_close(padded.advantages[:, :width], base.advantages)
    torch.testing.assert_close(padded.returns[:, :width], base.returns)
    assert (padded.advantages[:, width:] == 0).all()


@pytest.mark.parametrize("name", ["reinforce_baseline", "rloo", "group_norm", "dr_grpo"])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 6), groups=st.integers(1, 4))
def test_group_scalar_step_is_zero_mean_per_group(name, seed, n, groups) -> None:
    rewards = torch.randn(n * groups, generator=torch.Generator().manual_seed(seed), dtype=F64)
    spec = ADVANTAGE_ESTIMATORS.get(name)
    out = GROUP_BASELINES.get(spec.baseline)(rewards, n_samples_per_prompt=n).view(groups, n)
    torch.testing.assert_close(out.mean(dim=1), torch.zeros(groups, dtype=F64), atol=1e-12, rtol=0)


def test_fully_masked_sequence_gives_zeros_not_nan() -> None:
    for name in ESTIMATORS:
        cfg = AdvantageConfig(estimator=name)
        out = compute_advantages(
            config=cfg,
            rewards=t([1.0, 0.0]),
            action_mask=t([[0, 0], [1, 1]]),
            n_samples_per_prompt=2,
            values=torch.zeros(2, 2, dtype=F64),
        )
        assert torch.isfinite(out.advantages).all(), name
        assert (out.advantages[0] == 0).all(), name


def test_bad_inputs_name_the_argument() -> None:
    cfg = AdvantageConfig(estimator="group_norm")
    with pytest.raises(ValueError, match="n_samples_per_prompt=4 does not divide the batch of 6"):
        compute_advantages(
            config=cfg, rewards=torch.zeros(6), action_mask=torch.ones(6, 2), n_samples_per_prompt=4
        )
    with pytest.raises(
        ValueError,
        match="unknown advantage estimator .ppo.; choose one of: distill, dr_grpo, flash_reinforce, gae",
    ):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValueError, match="values \\(critic\\) are required"):
        compute_advantages(
            config=AdvantageConfig(), rewards=torch.zeros(2), action_mask=torch.ones(2, 2)
        )
    with pytest.raises(ValueError, match="rewards must have 1 dimensions"):
        compute_advantages(
            config=cfg,
            rewards=torch.zeros(2, 1),
            action_mask=torch.ones(2, 2),
            n_samples_per_prompt=2,
        )
    with pytest.raises(ValueError, match="rewards must be a floating-point tensor"):
        compute_advantages(
            config=cfg,
            rewards=torch.zeros(2, dtype=torch.long),
            action_mask=torch.ones(2, 2),
            n_samples_per_prompt=2,
        )
    with pytest.raises(
        ValueError, match="values has shape \\(2, 3\\) but must match token_rewards"
    ):
        compute_advantages(
            config=AdvantageConfig(),
            rewards=torch.zeros(2),
            action_mask=torch.ones(2, 2),
            values=torch.zeros(2, 3),
        )
    with pytest.raises(ValueError, match="n_samples_per_prompt must be >= 2 for a leave-one-out"):
        compute_advantages(
            config=AdvantageConfig(estimator="rloo"),
            rewards=torch.zeros(2),
            action_mask=torch.ones(2, 2),
        )
    with pytest.raises(ValueError, match="advantage.gamma must be in \\[0, 1\\]"):
        AdvantageConfig(gamma=1.5)
