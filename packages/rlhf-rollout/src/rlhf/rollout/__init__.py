"""rlhf.rollout: vLLM engines behind the `rlhf.agents.Generator` protocol.

At this stage: `EngineConfig` and `VLLMEngine`, an in-process vllm engine driven by one
background thread (token ids in, token ids + processed log-probs out). Engine pools, Ray actors
and weight receiving are tracked in issue 4. It may import `rlhf.agents` only.
"""

from rlhf.rollout.config import EngineConfig
from rlhf.rollout.engine import EngineError, VLLMEngine

__all__ = ["EngineConfig", "EngineError", "VLLMEngine"]
