"""rlhf.rollout: vLLM engines behind the `rlhf.agents.Generator` protocol.

`VLLMEngine` runs one in-process vLLM engine from a background thread (token ids in, token ids
and processed log-probs out; pause/resume, sleep/wake, verified weight updates); `EnginePool`
dispatches over several by load; `spawn_engines` starts engines as Ray actors behind
`RayEngine` handles with the same methods. Weights arrive in the `rlhf.weights` wire format
over its transports. `run_synchronous` / `run_asynchronous` decide when a loop's batches
are sampled, trained on and synced (`rlhf.rollout.schedule`: versions, staleness, a bounded
queue of `Rollout` s); `sample_step` draws and samples one step's prompts with dynamic
filtering's refill (`rlhf.rollout.sampling`); `RolloutDump` writes every step's rollout to disk
and reads it back bit for bit (safetensors + JSON: replay, offline debugging). It may import
`rlhf.agents` and `rlhf.weights` only.
"""

from rlhf.rollout.config import EngineConfig, EngineOptions
from rlhf.rollout.conformance import ConformanceReport, check_logprobs, processed_logprobs
from rlhf.rollout.dump import DUMP_FORMAT, DumpError, RolloutDump
from rlhf.rollout.engine import VLLMEngine
from rlhf.rollout.errors import EngineError
from rlhf.rollout.pool import EnginePool, Revive
from rlhf.rollout.ray_engine import (
    EngineActor,
    EngineDiedError,
    RayEngine,
    TransportSync,
    spawn_engines,
)
from rlhf.rollout.readback import VERIFY_MODES, LiveDigest, spot_check_names
from rlhf.rollout.sampling import (
    EmptyStepError,
    GroupFilter,
    PromptSource,
    pass_at,
    sample_step,
)
from rlhf.rollout.schedule import Rollout, StepRunner, run_asynchronous, run_synchronous
from rlhf.rollout.weight_checks import read_checkpoint_params

__all__ = [
    "DUMP_FORMAT",
    "VERIFY_MODES",
    "ConformanceReport",
    "DumpError",
    "EmptyStepError",
    "EngineActor",
    "EngineConfig",
    "EngineDiedError",
    "EngineError",
    "EngineOptions",
    "EnginePool",
    "GroupFilter",
    "LiveDigest",
    "PromptSource",
    "RayEngine",
    "Revive",
    "Rollout",
    "RolloutDump",
    "StepRunner",
    "TransportSync",
    "VLLMEngine",
    "check_logprobs",
    "pass_at",
    "processed_logprobs",
    "read_checkpoint_params",
    "run_asynchronous",
    "run_synchronous",
    "sample_step",
    "spawn_engines",
    "spot_check_names",
]
