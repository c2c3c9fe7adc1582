"""rlhf.agents: how a sample is produced and scored, in token space.

The `Generator` protocol (token ids in, token ids + log-probs out) is what rollout engines
implement; executors turn prompts into `Trajectory` objects with exact token streams, action
masks and aligned log-probs; reward functions (a Python file or HTTP servers speaking OpenRLHF's
wire format) and multi-turn environments (``reset``/``step``) score them, with explicit failure
policies. It imports no other rlhf package.
"""

from rlhf.agents.agent_executor import AgentError, OpenAIAgentExecutor
from rlhf.agents.agent_files import AgentFile, AgentFileError, AgentShape, has_chat_template
from rlhf.agents.environments import (
    Environment,
    EnvironmentFactory,
    EnvironmentStepError,
    StepResult,
)
from rlhf.agents.groups import sample_group
from rlhf.agents.loading import load_module, load_symbol
from rlhf.agents.multi_turn import MultiTurnExecutor
from rlhf.agents.openai_server import OpenAICompatibleServer, Session, SessionError
from rlhf.agents.remote import RemoteReward, RemoteRewardConfig, shard_bounds
from rlhf.agents.rewards import (
    FailurePolicy,
    FunctionReward,
    RewardBatch,
    RewardError,
    RewardScorer,
    parse_reward_output,
)
from rlhf.agents.seeds import group_seed, nth_sample, request_seed, seeded
from rlhf.agents.single_turn import Executor, ExecutorResult, SingleTurnExecutor, merge_results
from rlhf.agents.tokens import ChatTurns, Tokenizer, encode_prompt
from rlhf.agents.types import (
    FinishReason,
    Generation,
    Generator,
    GroupGenerator,
    SamplingParams,
    Trajectory,
)

__all__ = [
    "AgentError",
    "AgentFile",
    "AgentFileError",
    "AgentShape",
    "ChatTurns",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentStepError",
    "Executor",
    "ExecutorResult",
    "FailurePolicy",
    "FinishReason",
    "FunctionReward",
    "Generation",
    "Generator",
    "GroupGenerator",
    "MultiTurnExecutor",
    "OpenAIAgentExecutor",
    "OpenAICompatibleServer",
    "RemoteReward",
    "RemoteRewardConfig",
    "RewardBatch",
    "RewardError",
    "RewardScorer",
    "SamplingParams",
    "Session",
    "SessionError",
    "SingleTurnExecutor",
    "StepResult",
    "Tokenizer",
    "Trajectory",
    "encode_prompt",
    "group_seed",
    "has_chat_template",
    "load_module",
    "load_symbol",
    "merge_results",
    "nth_sample",
    "parse_reward_output",
    "request_seed",
    "sample_group",
    "seeded",
    "shard_bounds",
]
