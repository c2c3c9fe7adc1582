"""rlhf.rollout: vLLM engines behind the `rlhf.agents.Generator` protocol.

At this stage: `EngineConfig` and `VLLMEngine`, an in-process vllm engine driven by one
background thread (token ids in, token ids + processed log-probs out). Engine pools, Ray actors
and weight receiving are tracked in issue 4. It may import `rlhf.agents` only.
"""

from rlhf.rollout.buckets import (
    CHECKSUMS,
    BucketHeader,
    TensorMeta,
    WeightBucket,
    WeightSyncError,
    as_uint8,
    bucket_from_wire,
    checksum,
    header_from_wire,
    iter_tensors,
    pack_buckets,
    validate_sync,
)
from rlhf.rollout.config import EngineConfig
from rlhf.rollout.conformance import ConformanceReport, check_logprobs, processed_logprobs
from rlhf.rollout.engine import EngineError, VLLMEngine, read_checkpoint_params
from rlhf.rollout.pool import EnginePool
from rlhf.rollout.ray_engine import EngineActor, RayEngine, spawn_engines

__all__ = [
    "CHECKSUMS",
    "BucketHeader",
    "ConformanceReport",
    "EngineActor",
    "EngineConfig",
    "EngineError",
    "EnginePool",
    "RayEngine",
    "TensorMeta",
    "VLLMEngine",
    "WeightBucket",
    "WeightSyncError",
    "as_uint8",
    "bucket_from_wire",
    "check_logprobs",
    "checksum",
    "header_from_wire",
    "iter_tensors",
    "pack_buckets",
    "processed_logprobs",
    "read_checkpoint_params",
    "spawn_engines",
    "validate_sync",
]
