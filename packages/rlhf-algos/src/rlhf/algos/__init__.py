"""rlhf.algos: pure tensor math for RLHF and RL with verifiable rewards.

Every function takes and returns torch tensors, has keyword-only arguments past the first two,
documents the shape of every tensor, and raises `ValueError` naming the argument on bad input.
Families of variants are registries (`Registry`) with one fixed signature each.
"""

from rlhf.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUP_BASELINES,
    TOKEN_STEPS,
    AdvantageConfig,
    Advantages,
    EstimatorSpec,
    TokenStep,
    TokenStepInputs,
    compute_advantages,
    discounted_returns,
    gae,
    reverse_kl_advantages,
)
from rlhf.algos.aggregation import AGGREGATIONS, Aggregation, aggregate_loss, loss_normalizer
from rlhf.algos.config import AlgoConfig
from rlhf.algos.correction import (
    CORRECTION_DIVERGENCES,
    CORRECTION_GATINGS,
    CORRECTION_LEVELS,
    RolloutCorrectionConfig,
    rollout_correction_weights,
)
from rlhf.algos.filtering import GroupFilter, dynamic_filter
from rlhf.algos.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    KLController,
    kl_penalty,
    make_kl_controller,
)
from rlhf.algos.linear_logprobs import linear_logprobs_and_entropy
from rlhf.algos.logprobs import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from rlhf.algos.masked import WhitenStats, masked_mean, masked_sum, masked_whiten, whiten_stats
from rlhf.algos.policy import POLICY_LOSSES, PolicyLossConfig, policy_loss
from rlhf.algos.preference import (
    PREFERENCE_LOSSES,
    REWARD_MODEL_LOSSES,
    dpo_loss,
    reward_model_loss,
)
from rlhf.algos.registry import Registry
from rlhf.algos.sft import sft_loss
from rlhf.algos.shaping import (
    clip_rewards,
    last_action_index,
    overlong_filter_mask,
    overlong_penalty,
    shape_token_rewards,
    stop_properly_penalty,
)
from rlhf.algos.value import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "CORRECTION_DIVERGENCES",
    "CORRECTION_GATINGS",
    "CORRECTION_LEVELS",
    "GROUP_BASELINES",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "REWARD_MODEL_LOSSES",
    "TOKEN_STEPS",
    "AdaptiveKLController",
    "AdvantageConfig",
    "Advantages",
    "Aggregation",
    "AlgoConfig",
    "EstimatorSpec",
    "FixedKLController",
    "GroupFilter",
    "KLConfig",
    "KLController",
    "PolicyLossConfig",
    "Registry",
    "RolloutCorrectionConfig",
    "TokenStep",
    "TokenStepInputs",
    "WhitenStats",
    "aggregate_loss",
    "clip_rewards",
    "clipped_value_loss",
    "compute_advantages",
    "discounted_returns",
    "dpo_loss",
    "dynamic_filter",
    "entropy_from_logits",
    "gae",
    "kl_penalty",
    "last_action_index",
    "linear_logprobs_and_entropy",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "loss_normalizer",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_filter_mask",
    "overlong_penalty",
    "policy_loss",
    "reverse_kl_advantages",
    "reward_model_loss",
    "rollout_correction_weights",
    "sft_loss",
    "shape_token_rewards",
    "stop_properly_penalty",
    "whiten_stats",
]
