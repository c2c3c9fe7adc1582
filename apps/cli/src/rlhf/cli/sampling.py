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

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from rlhf.algos import AlgoConfig, dynamic_filter
from rlhf.cli.config import ConfigError
from rlhf.cli.sections import RewardConfig, RolloutConfig, TrainConfig
from rlhf.rollout.sampling import GroupFilter

if TYPE_CHECKING:
    from rlhf.agents import (
        AgentFile,
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
    from rlhf.agents import FailurePolicy, FunctionReward, RemoteReward, RemoteRewardConfig

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
    try:
        return FunctionReward.from_spec(
            reward.reward_func, policy=policy, timeout_s=reward.timeout_s
        )
    except ValueError as exc:
        if reward.reward_func.startswith("builtin:"):
            raise ConfigError(f"--reward.reward_func={exc}") from None
        raise _bad_reward_file(reward.reward_func, exc) from None
    except (OSError, ImportError, AttributeError) as exc:
        raise _bad_reward_file(reward.reward_func, exc) from None


def _bad_reward_file(path: str, exc: Exception) -> ConfigError:
    return ConfigError(
        f"the reward file {path}: {exc} (run `python {path}` to see the error in full)"
    )


def agent_file(path: str, *, chat_template: bool) -> AgentFile:
    """The ``--train.agent_func_path`` file, loaded and checked against the shape it has
    (`rlhf.agents.AgentFile`); a `ConfigError` naming the flag and the file."""
    from rlhf.agents import AgentFile

    try:
        return AgentFile.load(path, chat_template=chat_template, purpose="--train.agent_func_path")
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(str(exc)) from None


def check_user_files(*, reward: RewardConfig, agent_path: str, policy_path: str) -> None:
    """The run's reward file (``reward``: ``config.resolved_reward()``) and agent file
    (``--train.agent_func_path``) imported and checked before Ray or any role starts, against
    the policy's tokenizer at ``policy_path``: a `ConfigError` naming the flag and the file.
    Imports are cached per file (`rlhf.agents.load_module`), so the executors reuse these
    modules."""
    from rlhf.agents import has_chat_template

    if not reward.remote_url and not reward.reward_func.startswith("builtin:"):
        reward_source(reward)
    if agent_path:
        agent_file(agent_path, chat_template=has_chat_template(policy_path))


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
        self.tokenizer, self.rollout, self.train = tokenizer, rollout, train
        self.generator: Generator | None = None
        self.reward = reward_source(reward)
        self.agent = (
            agent_file(
                train.agent_func_path, chat_template=bool(getattr(tokenizer, "chat_template", None))
            )
            if train.agent_func_path
            else None
        )
        self._training: Executor | None = None

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
        """The executor of training rollouts: the agent file's (`rlhf.agents.AgentFile`), or
        single-turn; built once."""
        from rlhf.agents import FailurePolicy

        if self._training is None:
            if self.agent is None:
                self._training = self.single_turn(self.rollout.temperature)
            else:
                train = self.train
                self._training = self.agent.executor(
                    tokenizer=self.tokenizer,
                    generator=self._generator(),
                    sampling=self._sampling(self.rollout.temperature),
                    max_len=self.rollout.max_len,
                    max_turns=train.agent_max_turns,
                    step_timeout_s=train.agent_step_timeout_s,
                    policy=FailurePolicy(
                        on_failure=train.agent_failure_policy,  # type: ignore[arg-type]
                        fallback_reward=train.agent_fallback_value,
                    ),
                )
        return self._training


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
