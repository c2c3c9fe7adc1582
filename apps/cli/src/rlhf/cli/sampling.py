"""Sampling for ``rlhf train``: where rewards come from, which executor turns prompts into
trajectories, and the dynamic-filtering predicate; a step's generation and the evaluation are
`rlhf.rollout.sampling`'s.

- Reward sources: ``--reward.reward_func`` (``builtin:<name>`` or a Python file) or
  ``--reward.remote_url`` (HTTP servers, OpenRLHF's wire format), under ``--reward.timeout_s``
  and ``--reward.failure_policy`` (the older ``--train.reward_func`` / ``--train.remote_url``
  spellings still work). A reward model
  (``--train.reward_model_path``) scores in the learner's experience phase instead.
- Executors: single-turn (`rlhf.agents.SingleTurnExecutor`, the reward source scores), or a
  ``--train.agent_func_path`` file: an ``Environment`` class (token-in, token-out multi-turn
  episodes) or an ``agent`` function (an OpenAI-client agent on 127.0.0.1). Evaluations are
  single-turn, scored by the reward function.
- `group_filter`: with ``--algo.dynamic_filtering_enable``, prompt groups whose mean score is
  outside the range are dropped (and replaced from further prompts by
  `rlhf.rollout.sampling.sample_step`).
"""

from __future__ import annotations

import json
import os
import pathlib
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from rlhf.algos import AlgoConfig, dynamic_filter
from rlhf.cli.config import ConfigError
from rlhf.cli.sections import RewardConfig, RolloutConfig, TrainConfig
from rlhf.rollout.sampling import GroupFilter

if TYPE_CHECKING:
    from rlhf.agents import (
        EnvironmentFactory,
        Executor,
        Generator,
        RewardScorer,
        SamplingParams,
        SingleTurnExecutor,
    )


def reward_source(reward: RewardConfig) -> RewardScorer:
    """The ``--reward.reward_func`` / ``--reward.remote_url`` scorer (`rlhf.agents`), under
    ``--reward.timeout_s`` and the failure policy (``config.resolved_reward()``: the older
    ``--train.*`` spellings filled in)."""
    from rlhf.agents import (
        FailurePolicy,
        FunctionReward,
        RemoteReward,
        RemoteRewardConfig,
        builtin_rewards,
    )

    policy = FailurePolicy(on_failure=reward.failure_policy, fallback_reward=reward.fallback_value)  # type: ignore[arg-type]
    if reward.remote_url:
        urls = tuple(u.strip() for u in reward.remote_url.split(",") if u.strip())
        try:
            config = RemoteRewardConfig(
                urls=urls,
                timeout_s=reward.timeout_s,
                max_retries=reward.retries,
                policy=policy,
                api_key=reward.api_key or os.environ.get("RLHF_REWARD_API_KEY") or None,
            )
        except ValueError as exc:
            raise ConfigError(f"--{exc}") from None
        return RemoteReward(config, report=lambda line: print(f"[reward] {line}", flush=True))
    if reward.reward_func.startswith("builtin:"):
        name = reward.reward_func.removeprefix("builtin:")
        func = getattr(builtin_rewards, name, None) if name in builtin_rewards.NAMES else None
        if func is None:
            raise ConfigError(
                f"--reward.reward_func={reward.reward_func}: no such builtin; use "
                f"{', '.join(f'builtin:{n}' for n in builtin_rewards.NAMES)}, or a Python file"
            )
        return FunctionReward(
            func, source=reward.reward_func, policy=policy, timeout_s=reward.timeout_s
        )
    try:
        return FunctionReward.from_file(
            reward.reward_func, policy=policy, timeout_s=reward.timeout_s
        )
    except (OSError, ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"the reward file {reward.reward_func}: {exc} (run `python {reward.reward_func}` "
            "to see the error in full)"
        ) from None


def agent_module(path: str) -> types.ModuleType:
    """The imported ``--train.agent_func_path`` file, or a `ConfigError` when it defines
    neither an ``Environment`` class nor an ``agent`` function."""
    from rlhf.agents.loading import load_module

    try:
        module = load_module(path, purpose="--train.agent_func_path")
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(str(exc)) from exc
    from rlhf.agents.openrlhf import is_agent_executor

    executor = getattr(module, "AgentExecutor", None)
    if executor is not None and not is_agent_executor(executor):
        raise ConfigError(
            f"--train.agent_func_path {path!r}: its AgentExecutor does not subclass "
            "AgentExecutorBase; an OpenRLHF agent file imports it (and AgentInstanceBase, "
            "MultiTurnAgentExecutor) from rlhf.agents.openrlhf instead of openrlhf.utils.agent"
        )
    shapes = (
        hasattr(module, "Environment"),
        callable(getattr(module, "agent", None)),
        executor is not None,
    )
    if not any(shapes):
        raise ConfigError(
            f"--train.agent_func_path {path!r} defines none of the accepted shapes: an "
            "`Environment` class (multi-turn environment: reset(prompt, label), step(action)), "
            "an `agent` function (OpenAI-client agent), or OpenRLHF's `AgentExecutor` class "
            "(an AgentExecutorBase, usually MultiTurnAgentExecutor over an AgentInstanceBase; "
            "import them from rlhf.agents.openrlhf)"
        )
    return module


def agent_environments(
    module: types.ModuleType | None, path: str, *, chat_template: bool
) -> EnvironmentFactory | None:
    """The agent file checked against the shape it has, before anything starts: its
    ``Environment`` class's factory (an instance can be made with no arguments), or, for an
    OpenAI-client ``agent``, a policy tokenizer with a chat template (``chat_template``) to
    render its messages; None for other shapes."""
    from rlhf.agents import EnvironmentFactory

    flag = f"--train.agent_func_path {path}"
    if module is None or (hasattr(module, "AgentExecutor") and not hasattr(module, "Environment")):
        return None
    if hasattr(module, "Environment"):
        try:
            return EnvironmentFactory(
                module.Environment, source=f"environment Environment in {path}"
            )
        except TypeError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
    if not chat_template:
        raise ConfigError(
            f"{flag} is an OpenAI-client agent, whose chat messages are rendered through the "
            "policy tokenizer's chat template, and the tokenizer of --actor.model.path has "
            "none: add a chat_template to its tokenizer_config.json (or write the agent as an "
            "Environment class, which works in tokens)"
        )
    return None


def has_chat_template(model_path: str) -> bool:
    """Whether the tokenizer files of ``model_path`` hold a chat template (read from the files,
    without loading the tokenizer)."""
    root = pathlib.Path(model_path)
    if (root / "chat_template.jinja").is_file() or (root / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((root / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def check_user_files(*, reward: RewardConfig, agent_path: str, policy_path: str) -> None:
    """The run's reward file (``reward``: ``config.resolved_reward()``) and agent file
    (``--train.agent_func_path``) imported and checked before Ray or any role starts, against
    the policy's tokenizer at ``policy_path``: a `ConfigError` naming the flag and the file.
    Imports are cached per file (`rlhf.agents.load_module`), so the executors reuse these
    modules."""
    if not reward.remote_url and not reward.reward_func.startswith("builtin:"):
        reward_source(reward)
    if agent_path:
        agent_environments(
            agent_module(agent_path), agent_path, chat_template=has_chat_template(policy_path)
        )


class Executors:
    """The executors of a run. Made before anything starts (a bad reward or agent file stops
    the run there); ``generator`` (the engine pool) is set once the engines run.

    Args:
        tokenizer: The policy's tokenizer.
        rollout: Sampling settings (``--rollout.*``).
        train: The agent file (``--train.*``).
        reward: The reward source and its failure policy (``config.resolved_reward()``).
    """

    def __init__(
        self, *, tokenizer: Any, rollout: RolloutConfig, train: TrainConfig, reward: RewardConfig
    ) -> None:
        self.tokenizer, self.rollout = tokenizer, rollout
        self.generator: Generator | None = None
        self.reward = reward_source(reward)
        self.agent_path = train.agent_func_path
        self.agent_max_turns = train.agent_max_turns
        self.agent_step_timeout_s = train.agent_step_timeout_s
        self.agent_policy = (train.agent_failure_policy, train.agent_fallback_value)
        self.agent = agent_module(self.agent_path) if self.agent_path else None
        self.environments = self._environments(tokenizer)
        self._training: Executor | None = None

    def _environments(self, tokenizer: Any) -> EnvironmentFactory | None:
        return agent_environments(
            self.agent,
            self.agent_path,
            chat_template=bool(getattr(tokenizer, "chat_template", None)),
        )

    def _generator(self) -> Generator:
        if self.generator is None:
            raise RuntimeError("Executors.generator is set once the engines run, before sampling")
        return self.generator

    def _sampling(self, temperature: float) -> SamplingParams:
        from rlhf.agents import SamplingParams

        eos = self.tokenizer.eos_token_id
        r = self.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=(eos,) if eos is not None else (),
        )

    def single_turn(self, temperature: float) -> SingleTurnExecutor:
        """Prompt → one completion, scored by the reward source."""
        from rlhf.agents import SingleTurnExecutor

        return SingleTurnExecutor(
            tokenizer=self.tokenizer,
            generator=self._generator(),
            reward=self.reward,
            sampling=self._sampling(temperature),
            max_len=self.rollout.max_len,
        )

    def training(self) -> Executor:
        """The executor of training rollouts (built once: an agent file is imported once)."""
        if self._training is None:
            self._training = (
                self._agent() if self.agent else self.single_turn(self.rollout.temperature)
            )
        return self._training

    def _agent(self) -> Executor:
        from rlhf.agents import FailurePolicy, MultiTurnExecutor, OpenAIAgentExecutor

        path, module = self.agent_path, self.agent
        assert module is not None  # only called when --train.agent_func_path is set
        common = {
            "tokenizer": self.tokenizer,
            "generator": self._generator(),
            "sampling": self._sampling(self.rollout.temperature),
            "max_len": self.rollout.max_len,
        }
        if hasattr(module, "AgentExecutor") and not hasattr(module, "Environment"):
            from rlhf.agents.openrlhf import OpenRLHFAgentRunner

            return OpenRLHFAgentRunner(
                executor=module.AgentExecutor(),
                source=f"AgentExecutor in {path}",
                step_timeout_s=self.agent_step_timeout_s,
                policy=FailurePolicy(
                    on_failure=self.agent_policy[0],  # type: ignore[arg-type]
                    fallback_reward=self.agent_policy[1],
                ),
                **common,
            )
        if self.environments is not None:
            return MultiTurnExecutor(
                environments=self.environments,
                max_turns=self.agent_max_turns,
                step_timeout_s=self.agent_step_timeout_s,
                policy=FailurePolicy(
                    on_failure=self.agent_policy[0],  # type: ignore[arg-type]
                    fallback_reward=self.agent_policy[1],
                ),
                **common,
            )
        return OpenAIAgentExecutor(agent=module.agent, source=f"agent in {path}", **common)


def group_filter(algo: AlgoConfig, *, n_samples_per_prompt: int) -> GroupFilter | None:
    """``--algo.dynamic_filtering_enable``: the `rlhf.rollout.sampling.GroupFilter` that keeps
    the prompt groups whose mean score is inside ``--algo.dynamic_filtering_range``
    (`rlhf.algos.dynamic_filter`); None when off."""
    if not algo.dynamic_filtering_enable:
        return None

    def keep(scores: Sequence[Sequence[float]]) -> list[bool]:
        flat = torch.tensor([s for group in scores for s in group])
        verdict = dynamic_filter(
            flat,
            n_samples_per_prompt=n_samples_per_prompt,
            score_range=algo.dynamic_filtering_range,
        )
        return verdict.keep_groups.tolist()

    return keep
