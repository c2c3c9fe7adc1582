"""``--train.turn_credit``: where an environment's per-turn rewards land, and what γ/λ make of
them (the placement of `rlhf.learner.Samples.from_trajectories` through `rlhf.algos.compute_advantages`)."""

from __future__ import annotations

import pytest
import torch

from rlhf.agents import Trajectory
from rlhf.algos import AdvantageConfig, compute_advantages
from rlhf.cli.config import ConfigError, replace
from rlhf.cli.presets import resolve
from rlhf.learner import Samples

GAMMA, LAM = 0.9, 0.8
# prompt (2) | turn 1: three actions | feedback (2) | turn 2: two actions
MASK = (0, 0, 1, 1, 1, 0, 0, 1, 1)
TURN_ENDS = (4, 8)


def episode(turn_rewards: tuple[float, float]) -> Trajectory:
    return Trajectory(
        token_ids=tuple(range(10, 19)), action_mask=MASK, rollout_logprobs=(0.0,) * 9,
        prompt_length=2, reward=sum(turn_rewards), turn_rewards=turn_rewards,
        score=sum(turn_rewards), truncated=False, finish_reason="stop", turn_ends=TURN_ENDS,
    )  # fmt: skip


def advantages(turn_rewards, *, per_turn: bool, estimator: str = "reinforce") -> list[float]:
    samples = Samples.from_trajectories([episode(turn_rewards)], per_turn=per_turn)
    mask = samples.action_mask
    out = compute_advantages(
        config=AdvantageConfig(
            estimator=estimator, gamma=GAMMA, lam=LAM, whiten=False, reward_clip=None
        ),
        rewards=samples.rewards,
        action_mask=mask,
        values=torch.zeros_like(mask) if estimator == "gae" else None,
        token_rewards=samples.token_rewards,
    ).advantages
    return [out[0, i].item() for i in range(len(MASK)) if MASK[i]]


def discounted(rewards_by_action: list[float], factor: float) -> list[float]:
    """Σ_k factor^k r_{t+k} over the action tokens only (feedback tokens are not steps)."""
    out, acc = [], 0.0
    for r in reversed(rewards_by_action):
        acc = r + factor * acc
        out.append(acc)
    return out[::-1]


@pytest.mark.parametrize("estimator", ["reinforce", "gae"])
def test_a_reward_at_turn_two_reaches_turn_one_by_gamma_and_lambda(estimator) -> None:
    # V = 0: GAE's advantage is the (γλ)-discounted sum of rewards, REINFORCE's the γ one.
    factor = GAMMA * LAM if estimator == "gae" else GAMMA
    only_turn_2 = advantages((0.0, 1.0), per_turn=True, estimator=estimator)
    assert only_turn_2 == pytest.approx(discounted([0, 0, 0, 0, 1.0], factor), abs=1e-6)
    # Turn 1's first action is four action tokens before the reward: factor^4.
    assert only_turn_2[0] == pytest.approx(factor**4, abs=1e-6)
    # A reward at turn 1 stays with turn 1 per turn; the episode sum moves it to the end.
    only_turn_1 = advantages((1.0, 0.0), per_turn=True, estimator=estimator)
    assert only_turn_1 == pytest.approx(discounted([0, 0, 1.0, 0, 0], factor), abs=1e-6)
    assert only_turn_1[3:] == [0.0, 0.0]
    summed = advantages((1.0, 0.0), per_turn=False, estimator=estimator)
    assert summed == pytest.approx(discounted([0, 0, 0, 0, 1.0], factor), abs=1e-6)


def test_per_turn_samples_keep_the_last_turn_as_the_reward() -> None:
    samples = Samples.from_trajectories([episode((0.25, 0.5))], per_turn=True)
    assert samples.rewards.tolist() == [0.5]
    assert samples.token_rewards is not None
    assert samples.token_rewards[0].tolist() == [0, 0, 0, 0, 0.25, 0, 0, 0, 0]
    assert Samples.from_trajectories([episode((0.25, 0.5))]).token_rewards is None


def test_per_turn_credit_is_refused_with_a_group_baseline(tmp_path) -> None:
    given = {"actor.model.path": str(tmp_path), "data.prompt_data": "x.jsonl"}

    def refusal(preset: str, credit: str) -> str:
        config = replace(resolve(preset), **given, **{"train.turn_credit": credit})
        try:
            config.validate()
        except ConfigError as exc:
            return str(exc)
        return ""

    message = refusal("grpo", "per_turn")
    assert "--train.turn_credit per_turn" in message
    assert "--algo.advantage.estimator group_norm" in message and "gae or reinforce" in message
    assert "turn_credit" not in refusal("reinforce", "per_turn")
    assert "--train.turn_credit must be one of episode, per_turn" in refusal("reinforce", "turns")
