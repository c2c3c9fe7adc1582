"""rlhf.learner: the training side of rlhf.

The RL phases (`make_experience`, `ppo_update`) over a typed `Experience`, written against the
`Role` protocol that `InProcessRole` (one rank here) and `LearnerGroup` (ranks as Ray actors)
implement; the `Backend` protocol those run, given as a factory (`DeepSpeedBackend`; FSDP2 in
``rlhf.molt``); objectives, configs, batches, checkpoints, data rows, prompt datasets
(`prompt_sources`: a resumable `PromptSampler` over `DataConfig`'s sources) and weight streaming.
Backend-neutral parts import with torch and transformers alone; `DeepSpeedBackend` needs
``rlhf-learner[deepspeed]`` and `LearnerGroup` ``rlhf-learner[ray]``, both imported lazily. It
may import ``rlhf.algos`` and ``rlhf.weights`` only.
"""

from typing import TYPE_CHECKING, Any

from rlhf.learner.backend import Backend, BackendFactory, Objective
from rlhf.learner.batch import (
    ActorFields,
    Batch,
    CriticFields,
    DPOFields,
    FieldName,
    LossMaskFields,
    MissingFieldsError,
    RewardModelFields,
    check_fields,
    collate,
    micro_batches,
    required_fields,
    shard,
    view,
)
from rlhf.learner.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    final_dir,
    latest_checkpoint,
    latest_intact_checkpoint,
    staging_dir,
    verify_checkpoint,
)
from rlhf.learner.config import (
    ROLE_KINDS,
    DeepSpeedConfig,
    LearnerConfig,
    ModelConfig,
    OptimizerConfig,
)
from rlhf.learner.data import DataError, TokenRow, preference_row, sft_row
from rlhf.learner.datasets import DataSourceError
from rlhf.learner.experience import Experience, Samples
from rlhf.learner.export import write_hf_export
from rlhf.learner.forward import (
    Packed,
    batch_logprobs,
    check_chunked_lm_head,
    check_packing,
    lm_head_parts,
    pack,
    sequence_scores,
    token_logprobs,
    token_values,
)
from rlhf.learner.models import (
    ModelLoadError,
    check_model_dir,
    checkpoint_digest,
    checkpoint_names,
    fingerprint,
    load_model,
    vocabulary_mismatch,
)
from rlhf.learner.objectives import (
    CriticObjective,
    DPOObjective,
    PPOActorObjective,
    RewardModelObjective,
    SFTObjective,
    sequence_logps,
)
from rlhf.learner.optim import build_optimizer, lr_lambda, param_groups
from rlhf.learner.phases import (
    ActionLogprobs,
    make_experience,
    per_sequence,
    per_token,
    ppo_update,
    sequence_scores_of,
    shape_rewards,
    teacher_logprobs,
    token_values_of,
)
from rlhf.learner.prompts import (
    DataConfig,
    LossyPrompts,
    Prompt,
    PromptSampler,
    PromptTokenizer,
    check_prompts,
    field_notes,
    load_prompts,
    lossy_prompts,
    prompt_sources,
    source_names,
)
from rlhf.learner.role import InProcessRole, MicroBatching, Role
from rlhf.learner.weights import RankSenders, SentWeights, send_weights, stream_weights

if TYPE_CHECKING:
    from rlhf.learner.deepspeed_backend import DeepSpeedBackend
    from rlhf.learner.ray_group import LearnerGroup

_LAZY = {
    "DeepSpeedBackend": "rlhf.learner.deepspeed_backend",
    "LearnerGroup": "rlhf.learner.ray_group",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlhf.learner' has no attribute {name!r}")


__all__ = [
    "ROLE_KINDS",
    "ActionLogprobs",
    "ActorFields",
    "Backend",
    "BackendFactory",
    "Batch",
    "CheckpointError",
    "CriticFields",
    "CriticObjective",
    "DPOFields",
    "DPOObjective",
    "DataConfig",
    "DataError",
    "DataSourceError",
    "DeepSpeedBackend",
    "DeepSpeedConfig",
    "Experience",
    "FieldName",
    "InProcessRole",
    "LearnerConfig",
    "LearnerGroup",
    "LossMaskFields",
    "LossyPrompts",
    "MicroBatching",
    "MissingFieldsError",
    "ModelConfig",
    "ModelLoadError",
    "Objective",
    "OptimizerConfig",
    "PPOActorObjective",
    "Packed",
    "Prompt",
    "PromptSampler",
    "PromptTokenizer",
    "RankSenders",
    "RewardModelFields",
    "RewardModelObjective",
    "Role",
    "SFTObjective",
    "Samples",
    "SentWeights",
    "TokenRow",
    "batch_logprobs",
    "build_optimizer",
    "check_chunked_lm_head",
    "check_fields",
    "check_model_dir",
    "check_packing",
    "check_prompts",
    "checkpoint_digest",
    "checkpoint_names",
    "collate",
    "complete_checkpoints",
    "field_notes",
    "final_dir",
    "fingerprint",
    "latest_checkpoint",
    "latest_intact_checkpoint",
    "lm_head_parts",
    "load_model",
    "load_prompts",
    "lossy_prompts",
    "lr_lambda",
    "make_experience",
    "micro_batches",
    "pack",
    "param_groups",
    "per_sequence",
    "per_token",
    "ppo_update",
    "preference_row",
    "prompt_sources",
    "required_fields",
    "send_weights",
    "sequence_logps",
    "sequence_scores",
    "sequence_scores_of",
    "sft_row",
    "shape_rewards",
    "shard",
    "source_names",
    "staging_dir",
    "stream_weights",
    "teacher_logprobs",
    "token_logprobs",
    "token_values",
    "token_values_of",
    "verify_checkpoint",
    "view",
    "vocabulary_mismatch",
    "write_hf_export",
]
