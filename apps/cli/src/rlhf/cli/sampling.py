"""Sampling for ``rlhf train``: where rewards come from, which executor turns prompts into
trajectories, one step's generation with dynamic filtering, and evaluation.

- Reward sources: ``--reward.reward_func`` (``builtin:<name>`` or a Python file) or
  ``--reward.remote_url`` (HTTP servers, OpenRLHF's wire format), under ``--reward.timeout_s``
  and ``--reward.failure_policy`` (the older ``--train.reward_func`` / ``--train.remote_url``
  spellings still work). A reward model
  (``--train.reward_model_path``) scores in the learner's experience phase instead.
- Executors: single-turn (`rlhf.agents.SingleTurnExecutor`, the reward source scores), or a
  ``--train.agent_func_path`` file: an ``Environment`` class (token-in, token-out multi-turn
  episodes) or an ``agent`` function (an OpenAI-client agent on 127.0.0.1). Evaluations are
  single-turn, scored by the reward function.
- `generate`: a step's prompts, sampled; with ``--algo.dynamic_filtering_enable`` prompt groups
  whose mean score is outside the range are dropped and replaced from further prompts (three
  extra draws at most).
"""

from __future__ import annotations

import array
import json
import os
import pathlib
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlhf.algos import AlgoConfig, dynamic_filter
from rlhf.cli.config import ConfigError, RunError
from rlhf.cli.data import Prompt, PromptSampler
from rlhf.cli.sections import EvalConfig, RewardConfig, RolloutConfig, TrainConfig
from rlhf.learner import Samples
from rlhf.rollout.schedule import Rollout


def reward_source(reward: RewardConfig) -> Any:
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


def agent_module(path: str) -> Any:
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


def agent_environments(module: Any, path: str, *, chat_template: bool) -> Any:
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
        self.generator: Any = None
        self.reward = reward_source(reward)
        self.agent_path = train.agent_func_path
        self.agent_max_turns = train.agent_max_turns
        self.agent_step_timeout_s = train.agent_step_timeout_s
        self.agent_policy = (train.agent_failure_policy, train.agent_fallback_value)
        self.agent = agent_module(self.agent_path) if self.agent_path else None
        self.environments = self._environments(tokenizer)
        self._training: Any = None

    def _environments(self, tokenizer: Any) -> Any:
        return agent_environments(
            self.agent,
            self.agent_path,
            chat_template=bool(getattr(tokenizer, "chat_template", None)),
        )

    def _sampling(self, temperature: float) -> Any:
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

    def single_turn(self, temperature: float) -> Any:
        """Prompt → one completion, scored by the reward source."""
        from rlhf.agents import SingleTurnExecutor

        return SingleTurnExecutor(
            tokenizer=self.tokenizer,
            generator=self.generator,
            reward=self.reward,
            sampling=self._sampling(temperature),
            max_len=self.rollout.max_len,
        )

    def training(self) -> Any:
        """The executor of training rollouts (built once: an agent file is imported once)."""
        if self._training is None:
            self._training = (
                self._agent() if self.agent else self.single_turn(self.rollout.temperature)
            )
        return self._training

    def _agent(self) -> Any:
        from rlhf.agents import FailurePolicy, MultiTurnExecutor, OpenAIAgentExecutor

        path, module = self.agent_path, self.agent
        assert module is not None  # only called when --train.agent_func_path is set
        common = {
            "tokenizer": self.tokenizer,
            "generator": self.generator,
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


TRAINING, EVALUATION = 0, 1
"""The two streams of request seeds under one run seed (`generate`, `evaluate`)."""


def empty_step_message(
    step: int, *, dropped_groups: int, incomplete: int, lost: Mapping[str, float], failure: str
) -> str:
    """Why step ``step`` (0-based) has no sample left to train on, cause by cause, each with
    the flag that decides it; ``failure`` is the first failure a policy absorbed."""
    causes = []
    if lost.get("env/skipped"):
        causes.append(
            f"{lost['env/skipped']:.0f} episodes failed and were left out by "
            "--train.agent_failure_policy (skip; or fallback, which has nothing to keep when an "
            "episode fails before the policy's first action, e.g. in reset())"
        )
    if lost.get("reward/failed"):
        causes.append(
            f"{lost['reward/failed']:.0f} samples' rewards failed and were skipped "
            "(--reward.failure_policy skip; fallback gives them --reward.fallback_value)"
        )
    if incomplete:
        causes.append(f"{incomplete} prompt groups lost samples and were dropped whole")
    if dropped_groups:
        causes.append(
            f"dynamic filtering dropped {dropped_groups} prompt groups whose mean score was "
            "outside --algo.dynamic_filtering_range"
        )
    why = "; ".join(causes) or "the executor returned no sample"
    first = f". The first failure: {failure}" if failure else ""
    return f"step {step + 1}: no sample is left to train on: {why}{first}"


def complete_groups(trajectories: Sequence[Any], n: int) -> list[list[Any]]:
    """Trajectories grouped by prompt, keeping only groups with all ``n`` samples (a reward's
    skip policy can drop samples)."""
    groups: dict[int, list[Any]] = {}
    for tr in trajectories:
        groups.setdefault(tr.prompt_index, []).append(tr)
    return [g for _, g in sorted(groups.items()) if len(g) == n]


async def generate(
    step: int,
    *,
    rollout: RolloutConfig,
    algo: AlgoConfig,
    sampler: PromptSampler,
    executor: Any,
    seed: int | None = None,
) -> Rollout:
    """Draw the prompts of ``step`` and sample them (with dynamic filtering's replacement
    draws); the engines serve whatever weights they hold. ``seed`` (the run's, when requests
    are seeded): draw ``a`` of the step seeds its requests from ``request_seed(seed,
    TRAINING, step, a)``."""
    from rlhf.agents import request_seed

    n = rollout.n_samples_per_prompt
    tick = time.perf_counter()
    trajectories: list[Any] = []
    gen_metrics: Mapping[str, float] = {}
    dropped_groups = incomplete = 0
    lost: dict[str, float] = {}
    failure = ""
    digest = 0
    for attempt in range(4 if algo.dynamic_filtering_enable else 1):
        need = rollout.batch_size - len(trajectories) // n
        if need <= 0:
            break
        prompts = sampler.next(need)
        digest = zlib.crc32("\x00".join(p.text for p in prompts).encode(), digest)
        result = await executor.run(
            prompts=[p.text for p in prompts],
            labels=[p.label for p in prompts],
            n_samples_per_prompt=n,
            seed=None if seed is None else request_seed(seed, TRAINING, step, attempt),
        )
        gen_metrics = result.metrics if attempt == 0 else gen_metrics
        for key in ("env/skipped", "reward/failed"):
            lost[key] = lost.get(key, 0.0) + result.metrics.get(key, 0.0)
        failure = failure or result.failure
        groups = complete_groups(result.trajectories, n)
        incomplete += len({t.prompt_index for t in result.trajectories}) - len(groups)
        if algo.dynamic_filtering_enable and groups:
            scores = torch.tensor([float(tr.score) for g in groups for tr in g])
            keep = dynamic_filter(
                scores, n_samples_per_prompt=n, score_range=algo.dynamic_filtering_range
            ).keep_groups.tolist()
            dropped_groups += len(groups) - sum(keep)
            groups = [g for g, k in zip(groups, keep, strict=True) if k]
        trajectories += [tr for g in groups for tr in g]
    trajectories = trajectories[: rollout.batch_size * n]
    if not trajectories:
        raise RunError(
            empty_step_message(
                step, dropped_groups=dropped_groups, incomplete=incomplete, lost=lost,
                failure=failure,
            )
        )  # fmt: skip
    metrics: dict[str, Any] = {
        "rollout/dropped_groups": float(dropped_groups),
        "data/prompts_crc32": digest,
        "rollout/samples_crc32": samples_digest(trajectories),
        **{
            k: float(v)
            for k, v in gen_metrics.items()
            if k.startswith(("rollout/truncated", "rollout/prompts_truncated", "reward/", "env/"))
        },
        "time/generation_s": time.perf_counter() - tick,
    }
    return Rollout(
        step=step, trajectories=trajectories, metrics=metrics, sampler_state=sampler.state_dict()
    )


def samples_digest(trajectories: Sequence[Any]) -> int:
    """CRC-32 of the trajectories' token ids, in batch order, each sample preceded by its
    length: equal digests, equal samples. (Packed 64-bit integers: a fifth of the time of
    their decimal text, 10 ms per 0.5M tokens on this machine; it runs on every step.)"""
    digest = 0
    for tr in trajectories:
        digest = zlib.crc32(array.array("q", (len(tr.token_ids), *tr.token_ids)).tobytes(), digest)
    return digest


def to_samples(trajectories: Sequence[Any], *, per_turn: bool = False) -> Samples:
    """`rlhf.agents.Trajectory` objects as the learner's `Samples`.

    ``per_turn`` (``--train.turn_credit per_turn``): a trajectory that knows its turns keeps
    its last turn's reward as the sample's reward (placed on its last action token) and puts
    each earlier turn's reward on that turn's last action token (``Samples.token_rewards``);
    one without turns keeps its whole reward."""
    rewards = [float(tr.reward) for tr in trajectories]
    token_rewards = None
    if per_turn:
        token_rewards = []
        for k, tr in enumerate(trajectories):
            row = [0.0] * len(tr.token_ids)
            if tr.turn_ends:
                for end, r in zip(tr.turn_ends[:-1], tr.turn_rewards[:-1], strict=True):
                    row[end] += float(r)
                rewards[k] = float(tr.reward) - sum(float(r) for r in tr.turn_rewards[:-1])
            token_rewards.append(row)
    return Samples.collate(
        token_ids=[tr.token_ids for tr in trajectories],
        action_mask=[tr.action_mask for tr in trajectories],
        rollout_logprobs=[tr.rollout_logprobs for tr in trajectories],
        rewards=rewards,
        truncated=[bool(tr.truncated) for tr in trajectories],
        token_rewards=token_rewards,
    )


def staleness(step: int, trajectories: Sequence[Any]) -> dict[str, float]:
    """How many updates behind the trained policy (version ``step``) each sample's weights
    were: mean and max over the samples whose engine reported a version."""
    behind = [step - t.weight_version for t in trajectories if t.weight_version is not None]
    if not behind:
        return {}
    return {
        "rollout/staleness_mean": sum(behind) / len(behind),
        "rollout/staleness_max": float(max(behind)),
    }


async def evaluate(
    executors: Executors,
    prompts: Mapping[str, Sequence[Prompt]],
    *,
    eval: EvalConfig,
    seed: int | None = None,
) -> dict[str, float]:
    """Per evaluation source, single-turn at ``eval.temperature``: `pass_at` of its prompts'
    ``eval.n_samples`` scores. ``seed`` (the run's, when requests are seeded): source ``i``
    seeds its requests from ``request_seed(seed, EVALUATION, i)`` at every evaluation, so
    evaluations differ only by the weights."""
    from rlhf.agents import request_seed

    out: dict[str, float] = {}
    k = eval.n_samples
    for i, (name, items) in enumerate(prompts.items()):
        items = items[: eval.max_prompts]
        result = await executors.single_turn(eval.temperature).run(
            prompts=[p.text for p in items],
            labels=[p.label for p in items],
            n_samples_per_prompt=k,
            seed=None if seed is None else request_seed(seed, EVALUATION, i),
        )
        scores: dict[int, list[float]] = {}
        for t in result.trajectories:
            scores.setdefault(t.prompt_index, []).append(float(t.score))
        per_prompt = [scores.get(i, [0.0]) for i in range(len(items))]
        for metric, value in pass_at(per_prompt, k=k, threshold=eval.solved_threshold).items():
            out[f"eval/{name}/{metric}"] = value
    return out


def pass_at(scores: Sequence[Sequence[float]], *, k: int, threshold: float) -> dict[str, float]:
    """Evaluation metrics of ``scores[prompt][sample]`` (``k`` samples each): ``pass@1`` (the
    fraction of a prompt's samples scoring at least ``threshold``, averaged over prompts),
    ``pass@k`` (the fraction of prompts with such a sample) and ``score_mean``."""
    n = max(len(scores), 1)
    solved = [[s >= threshold for s in row] for row in scores]
    return {
        "pass@1": sum(sum(row) / len(row) for row in solved if row) / n,
        f"pass@{k}": sum(any(row) for row in solved) / n,
        "score_mean": sum(sum(row) / len(row) for row in scores if row) / n,
    }
