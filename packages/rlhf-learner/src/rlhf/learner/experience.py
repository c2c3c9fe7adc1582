"""What the RL phases hand each other: `Samples` (rollout output, collated) and `Experience`
(everything one PPO update trains on).

Shapes: B samples, each right-padded to L tokens. Per-token tensors are aligned with the
tokens: position ``t`` refers to token ``t`` (its log-prob is that of token ``t`` given the
tokens before it; position 0 is never an action), as `rlhf.learner.Batch` and the rollout's
trajectories align them. Prompt groups are consecutive: with n samples per prompt, rows
``[k n, (k + 1) n)`` share a prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from rlhf.learner.batch import Batch, FieldName, collate


def masked_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of (B, L) ``values`` over the positions where ``mask`` is 1."""
    return float((values * mask).sum() / mask.sum().clamp(min=1))


class TrajectoryLike(Protocol):
    """What `Samples.from_trajectories` reads of a sample (``rlhf.agents.Trajectory`` has it;
    the learner does not import the agents package)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def action_mask(self) -> Sequence[float]: ...

    @property
    def rollout_logprobs(self) -> Sequence[float]: ...

    @property
    def reward(self) -> float: ...

    @property
    def truncated(self) -> bool: ...

    @property
    def turn_rewards(self) -> Sequence[float]: ...

    @property
    def turn_ends(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class Samples:
    """One step's rollout, collated.

    Attributes:
        sequences: (B, L) long token ids: prompt, the policy's actions and any environment
            feedback, right-padded with 0.
        attention_mask: (B, L) long, 1 on real tokens.
        action_mask: (B, L) float, 1 where the policy produced the token.
        rollout_logprobs: (B, L) float, the sampler's log-prob of each action token (0
            elsewhere).
        rewards: (B,) float, each sample's reward (an episode's sum for multi-turn runs; its
            last turn's under per-turn credit, with the earlier turns in ``token_rewards``).
        truncated: (B,) bool, the sample hit the generation budget.
        token_rewards: (B, L) float rewards placed on action tokens besides ``rewards`` (per-turn
            credit: each earlier turn's reward on that turn's last action token), or None.
    """

    sequences: Tensor
    attention_mask: Tensor
    action_mask: Tensor
    rollout_logprobs: Tensor
    rewards: Tensor
    truncated: Tensor
    token_rewards: Tensor | None = None

    @classmethod
    def collate(
        cls,
        *,
        token_ids: Sequence[Sequence[int]],
        action_mask: Sequence[Sequence[float]],
        rollout_logprobs: Sequence[Sequence[float]],
        rewards: Sequence[float],
        truncated: Sequence[bool],
        token_rewards: Sequence[Sequence[float]] | None = None,
        pad_token_id: int = 0,
    ) -> Samples:
        """Right-pad per-sample lists (as ``rlhf.agents.Trajectory`` holds them)."""
        per_token: dict[FieldName, Sequence[Sequence[float]]] = {
            "action_mask": action_mask,
            "rollout_logprobs": rollout_logprobs,
        }
        if token_rewards is not None:
            per_token["token_rewards"] = token_rewards
        batch = collate(token_ids, pad_token_id=pad_token_id, per_token=per_token)
        return cls(
            sequences=batch.input_ids,
            attention_mask=batch.attention_mask,
            action_mask=batch["action_mask"],
            rollout_logprobs=batch["rollout_logprobs"],
            rewards=torch.tensor([float(r) for r in rewards]),
            truncated=torch.tensor([bool(t) for t in truncated]),
            token_rewards=batch["token_rewards"] if token_rewards is not None else None,
        )

    @classmethod
    def from_trajectories(
        cls, trajectories: Sequence[TrajectoryLike], *, per_turn: bool = False
    ) -> Samples:
        """Trajectories (``rlhf.agents.Trajectory``) collated.

        ``per_turn`` (per-turn credit): a trajectory that knows its turns keeps its last
        turn's reward as the sample's reward (placed on its last action token) and puts each
        earlier turn's reward on that turn's last action token (``token_rewards``); one
        without turns keeps its whole reward."""
        rewards = [float(tr.reward) for tr in trajectories]
        token_rewards = None
        if per_turn:
            token_rewards = []
            for k, tr in enumerate(trajectories):
                row = [0.0] * len(tr.token_ids)
                if tr.turn_ends:
                    earlier = tr.turn_rewards[:-1]
                    for end, r in zip(tr.turn_ends[:-1], earlier, strict=True):
                        row[end] += float(r)
                    rewards[k] = float(tr.reward) - sum(float(r) for r in earlier)
                token_rewards.append(row)
        return cls.collate(
            token_ids=[tr.token_ids for tr in trajectories],
            action_mask=[tr.action_mask for tr in trajectories],
            rollout_logprobs=[tr.rollout_logprobs for tr in trajectories],
            rewards=rewards,
            truncated=[bool(tr.truncated) for tr in trajectories],
            token_rewards=token_rewards,
        )

    @property
    def size(self) -> int:
        """B."""
        return int(self.sequences.shape[0])

    def batch(self) -> Batch:
        """The samples as a learner `Batch` (fields ``action_mask``, ``rollout_logprobs``)."""
        return Batch(
            self.sequences,
            self.attention_mask,
            {"action_mask": self.action_mask, "rollout_logprobs": self.rollout_logprobs},
        )


@dataclass(frozen=True)
class Experience:
    """Everything one PPO update needs, made by `rlhf.learner.make_experience`.

    Attributes:
        sequences: (B, L) long token ids, right-padded.
        attention_mask: (B, L) long, 1 on real tokens.
        action_mask: (B, L) float, 1 on the action tokens that train (DAPO's overlong
            filtering zeroes truncated samples' rows).
        rollout_logprobs: (B, L) float, the sampler's log-probs (importance correction and
            the sampler/learner gap metric).
        old_logprobs: (B, L) float log π_old, the actor's before this update; None when one
            optimizer step follows the rollout, where π_old is the policy itself (the actor
            objective then uses its own detached log-probs and a forward pass is saved).
        ref_logprobs: (B, L) float log π_ref of the reference model; None without a reference.
        values: (B, L) float critic values V(s_t) before this update; None without a critic.
        kl: (B, L) float per-token KL estimate of π_old (or the sampler) against π_ref; None
            without a reference.
        rewards: (B,) float reward before shaping (the samples' own, or the reward model's
            scores).
        shaped_rewards: (B,) float reward after length penalties, what advantages use.
        advantages: (B, L) float, 0 off the action mask.
        returns: (B, L) float value targets, 0 off the action mask.
        truncated: (B,) bool, the sample hit the generation budget.
        metrics: Scalar metrics of the phase (``reward/*``, ``rollout/*``, ``advantages/*``,
            ``kl/mean``, ``check/*``, ``distill/*``).
        teacher_logprobs: (B, L) float log π_T of each sample's teacher (on-policy
            distillation); None without teachers.
    """

    sequences: Tensor
    attention_mask: Tensor
    action_mask: Tensor
    rollout_logprobs: Tensor
    old_logprobs: Tensor | None
    ref_logprobs: Tensor | None
    values: Tensor | None
    kl: Tensor | None
    rewards: Tensor
    shaped_rewards: Tensor
    advantages: Tensor
    returns: Tensor
    truncated: Tensor
    metrics: Mapping[str, float] = field(default_factory=dict)
    teacher_logprobs: Tensor | None = None

    @property
    def size(self) -> int:
        """B."""
        return int(self.sequences.shape[0])

    @property
    def mean_kl(self) -> float | None:
        """Mean of ``kl`` over action tokens (what an adaptive KL controller follows)."""
        return None if self.kl is None else masked_mean(self.kl, self.action_mask)

    def batch(self) -> Batch:
        """The fields the objectives read, as a learner `Batch`: ``action_mask``,
        ``rollout_logprobs``, ``advantages``, ``returns`` and, when present, ``old_logprobs``,
        ``ref_logprobs``, ``old_values``."""
        fields: dict[FieldName, Tensor] = {
            "action_mask": self.action_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "advantages": self.advantages,
            "returns": self.returns,
        }
        optional: dict[FieldName, Tensor | None] = {
            "old_logprobs": self.old_logprobs,
            "ref_logprobs": self.ref_logprobs,
            "old_values": self.values,
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        return Batch(self.sequences, self.attention_mask, fields)
