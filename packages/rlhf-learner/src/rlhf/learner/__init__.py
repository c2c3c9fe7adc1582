"""rlhf.learner: the training side of rlhf.

Backend-neutral parts (configs, batches, objectives, checkpoint layout, weight buckets, data
rows) import with torch and transformers alone; `DeepSpeedBackend` needs ``rlhf-learner
[deepspeed]`` and `LearnerGroup` ``rlhf-learner[ray]``, both imported lazily. It may import
``rlhf.algos`` only.
"""

from typing import TYPE_CHECKING, Any

from rlhf.learner.backend import Backend, Objective
from rlhf.learner.batch import Batch, collate, micro_batches, shard
from rlhf.learner.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    final_dir,
    latest_checkpoint,
    staging_dir,
)
from rlhf.learner.config import (
    ROLE_KINDS,
    DeepSpeedConfig,
    LearnerConfig,
    ModelConfig,
    OptimizerConfig,
)
from rlhf.learner.cuda_ipc import CudaIpcShare, share_cuda_ipc
from rlhf.learner.data import DataError, TokenRow, preference_row, sft_row
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
from rlhf.learner.models import ModelLoadError, check_model_dir, fingerprint, load_model
from rlhf.learner.objectives import (
    CriticObjective,
    DPOObjective,
    PPOActorObjective,
    RewardModelObjective,
    SFTObjective,
    sequence_logps,
)
from rlhf.learner.optim import build_optimizer, lr_lambda, param_groups
from rlhf.learner.weights import count_buckets, iter_buckets

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
    "Backend",
    "Batch",
    "CheckpointError",
    "CriticObjective",
    "CudaIpcShare",
    "DPOObjective",
    "DataError",
    "DeepSpeedBackend",
    "DeepSpeedConfig",
    "LearnerConfig",
    "LearnerGroup",
    "ModelConfig",
    "ModelLoadError",
    "Objective",
    "OptimizerConfig",
    "PPOActorObjective",
    "Packed",
    "RewardModelObjective",
    "SFTObjective",
    "TokenRow",
    "batch_logprobs",
    "build_optimizer",
    "check_chunked_lm_head",
    "check_model_dir",
    "check_packing",
    "collate",
    "complete_checkpoints",
    "count_buckets",
    "final_dir",
    "fingerprint",
    "iter_buckets",
    "latest_checkpoint",
    "lm_head_parts",
    "load_model",
    "lr_lambda",
    "micro_batches",
    "pack",
    "param_groups",
    "preference_row",
    "sequence_logps",
    "sequence_scores",
    "sft_row",
    "shard",
    "share_cuda_ipc",
    "staging_dir",
    "token_logprobs",
    "token_values",
]
