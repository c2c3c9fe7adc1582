"""Reward shaping helpers and the dynamic-filtering predicate."""

import pytest
import torch

from rlhf.algos import (
    AlgoConfig,
    clip_rewards,
    dynamic_filter,
    last_action_index,
    overlong_filter_mask,
    overlong_penalty,
    shape_token_rewards,
    stop_properly_penalty,
)

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def test_scalar_reward_sits_on_the_last_action_token_of_each_row() -> None:
    # Row 0: actions at 0, 1 and 3 (2 is environment feedback) → reward on 3.
    # Row 1: no actions → nothing. Row 2: per-turn extra reward 0.5 on its first action token.
    mask = t([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    extra = t([[0, 0, 7, 0, 0], [0, 0, 0, 0, 0], [0.5, 0, 0, 0, 0]])
    out = shape_token_rewards(rewards=t([2.0, 5.0, 1.0]), action_mask=mask, token_rewards=extra)
    torch.testing.assert_close(out, t([[0, 0, 0, 2.0, 0], [0, 0, 0, 0, 0], [0.5, 1.0, 0, 0, 0]]))
    assert last_action_index(mask).tolist() == [3, -1, 1]


def test_kl_in_reward_ignores_masked_positions() -> None:
    out = shape_token_rewards(
        rewards=t([0.0]), action_mask=t([[1, 0]]), kl=t([[1.0, 100.0]]), kl_coef=0.5
    )
    torch.testing.assert_close(out, t([[-0.5, 0.0]]))


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="action_mask must have shape \\(B, T\\) with B=2"):
        shape_token_rewards(rewards=t([1.0, 2.0]), action_mask=torch.ones(3, 4))
    with pytest.raises(ValueError, match="kl has shape \\(2, 3\\) but must match action_mask"):
        shape_token_rewards(
            rewards=t([1.0, 2.0]), action_mask=torch.ones(2, 4), kl=torch.zeros(2, 3), kl_coef=0.1
        )
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0"):
        shape_token_rewards(rewards=t([1.0]), action_mask=torch.ones(1, 1), kl_coef=-1.0)


def test_clip_rewards() -> None:
    torch.testing.assert_close(
        clip_rewards(t([-20.0, 3.0, 20.0]), clip_range=(-10, 10)), t([-10.0, 3.0, 10.0])
    )
    with pytest.raises(ValueError, match="clip_range must satisfy low <= high"):
        clip_rewards(t([1.0]), clip_range=(1.0, -1.0))
    with pytest.raises(ValueError, match="clip_range must not contain NaN"):
        clip_rewards(t([1.0]), clip_range=(float("nan"), 1.0))


def test_overlong_penalty_is_linear_inside_the_buffer() -> None:
    # L_exp = 80: len 85 → −5/20·2 = −0.5 with factor 2; len 100 → −2; beyond stays −2.
    out = overlong_penalty(
        response_lengths=torch.tensor([80, 85, 100, 130]),
        max_new_tokens=100,
        buffer_len=20,
        penalty_factor=2.0,
    )
    torch.testing.assert_close(out, torch.tensor([0.0, -0.5, -2.0, -2.0]))
    with pytest.raises(
        ValueError, match="buffer_len must satisfy 0 < buffer_len <= max_new_tokens=100"
    ):
        overlong_penalty(response_lengths=torch.tensor([1]), max_new_tokens=100, buffer_len=200)


def test_stop_properly_penalty_scales_or_replaces() -> None:
    rewards, truncated = t([1.0, 2.0]), torch.tensor([True, False])
    torch.testing.assert_close(
        stop_properly_penalty(rewards, truncated=truncated, coef=0.5), t([0.5, 2.0])
    )
    torch.testing.assert_close(
        stop_properly_penalty(rewards, truncated=truncated, coef=-1.0), t([-1.0, 2.0])
    )
    with pytest.raises(ValueError, match="coef must be in \\[0, 1\\]"):
        stop_properly_penalty(rewards, truncated=truncated, coef=2.0)
    with pytest.raises(ValueError, match="truncated must be a bool tensor"):
        stop_properly_penalty(rewards, truncated=torch.tensor([0.5, 0.0]), coef=0.5)


def test_overlong_filter_mask_zeroes_truncated_rows() -> None:
    mask = torch.tensor([[True, True], [True, False]])
    out = overlong_filter_mask(mask, truncated=torch.tensor([True, False]))
    assert out.tolist() == [[False, False], [True, False]]
    with pytest.raises(ValueError, match="truncated must have shape \\(B,\\)=\\(2,\\)"):
        overlong_filter_mask(mask, truncated=torch.tensor([True]))


def test_dynamic_filter_keeps_groups_strictly_inside_the_range() -> None:
    # Groups: all 0 (drop), mixed (keep), all 1 (drop), mixed (keep).
    scores = t([0, 0, 0, 1, 1, 1, 1, 0])
    out = dynamic_filter(scores, n_samples_per_prompt=2)
    assert out.keep_groups.tolist() == [False, True, False, True]
    assert out.keep_samples.tolist() == [False, False, True, True, False, False, True, True]
    torch.testing.assert_close(out.group_mean, t([0.0, 0.5, 1.0, 0.5]))
    torch.testing.assert_close(out.group_std, t([0.0, 2**-0.5, 0.0, 2**-0.5]))
    assert out.metrics["filter/kept_frac"].item() == 0.5
    assert out.metrics["filter/low_frac"].item() == 0.25


def test_dynamic_filter_errors() -> None:
    with pytest.raises(ValueError, match="n_samples_per_prompt=3 does not divide the batch of 8"):
        dynamic_filter(torch.zeros(8), n_samples_per_prompt=3)
    with pytest.raises(ValueError, match="score_range must satisfy low < high"):
        dynamic_filter(torch.zeros(4), n_samples_per_prompt=2, score_range=(0.5, 0.5))


def test_algo_config_validates_cross_field_rules() -> None:
    assert AlgoConfig().loss_agg_mode == "token-mean"
    with pytest.raises(ValueError, match="algo.loss_agg_max_len must be set"):
        AlgoConfig(loss_agg_mode="seq-mean-token-sum-norm")
    assert (
        AlgoConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_agg_max_len=512).loss_agg_max_len
        == 512
    )
    with pytest.raises(ValueError, match="algo.dynamic_filtering_range must satisfy low < high"):
        AlgoConfig(dynamic_filtering_range=(1.0, 0.0))
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        AlgoConfig(loss_agg_mode="tokenmean")
