"""Multi-turn executor: token-in-token-out episodes against a user's environment.

Per sample: encode the prompt (left-truncated), ``reset`` a fresh environment, then alternate
generation and ``step``. The policy's tokens are kept exactly as sampled; the environment's
feedback is rendered as a new user turn through the chat template (see `ChatTurns`) and appended
as tokens with action mask 0. The episode ends when the environment says ``done``; reaching
``max_turns`` or the ``max_len`` token budget ends it with ``truncated=True``. Rewards are kept per
turn and summed. An environment that raises or returns the wrong type fails the sample with a
message naming the environment, the prompt index and the turn.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence

from rlhf.agents._aio import gather_or_cancel, in_daemon_thread
from rlhf.agents.environments import (
    EnvironmentFactory,
    EnvironmentStepError,
    coerce_step_result,
    maybe_await,
)
from rlhf.agents.loading import user_traceback
from rlhf.agents.rewards import FailurePolicy
from rlhf.agents.seeds import seeded
from rlhf.agents.single_turn import ExecutorResult, batch_indices
from rlhf.agents.tokens import ChatTurns, Tokenizer, encode_prompt
from rlhf.agents.types import FinishReason, Generator, SamplingParams, Trajectory


class MultiTurnExecutor:
    """Run multi-turn episodes.

    Args:
        tokenizer: Tokenizer with (ideally) a chat template.
        generator: Samples each policy turn in token space.
        environments: Makes one environment per sample.
        sampling: Per-turn sampling parameters (``max_new_tokens`` per turn); a step may override
            them for the next turn.
        max_len: Token budget of the whole episode (prompt + all turns).
        max_turns: Most policy turns per episode.
        max_prompt_len: Prompt budget; None uses ``max_len − sampling.max_new_tokens``.
        step_timeout_s: Deadline of one ``reset()`` or ``step()`` call; past it the episode
            fails with `EnvironmentStepError` (None: no deadline). Synchronous methods run on
            a daemon thread of their own, so a slow one does not hold up the other episodes
            and one that never returns cannot keep the process alive.
        policy: What a failed episode (an `EnvironmentStepError`: the environment raised,
            timed out or returned something malformed) becomes: ``raise`` (the batch fails),
            ``skip`` (the episode is left out) or ``fallback`` (it ends where it failed, with
            ``fallback_reward`` as its reward, truncated; one that failed before the policy's
            first action is skipped). Counted per batch in ``env/failed``, ``env/skipped``
            and ``env/fallback``.
    """

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        generator: Generator,
        environments: EnvironmentFactory,
        sampling: SamplingParams,
        max_len: int,
        max_turns: int,
        max_prompt_len: int | None = None,
        step_timeout_s: float | None = None,
        policy: FailurePolicy | None = None,
    ) -> None:
        self.policy = policy or FailurePolicy()
        if step_timeout_s is not None and not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 or None, got {step_timeout_s}")
        self.step_timeout_s = step_timeout_s
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_prompt_len = max_prompt_len or max_len - sampling.max_new_tokens
        if self.max_prompt_len < 1 or self.max_prompt_len >= max_len:
            raise ValueError(f"max_len={max_len} leaves no room for prompt and completion")
        self.tokenizer = tokenizer
        self.generator = generator
        self.environments = environments
        self.sampling = sampling
        self.max_len = max_len
        self.max_turns = max_turns
        self.turns = ChatTurns(tokenizer)

    async def _episode(
        self,
        prompt: str,
        label: object,
        prompt_index: int,
        sample_index: int,
        seed: int | None,
        progress: _Progress,
    ) -> Trajectory:
        where = f"{self.environments.source} (prompt {prompt_index}, sample {sample_index})"
        prompt_ids, _ = encode_prompt(self.tokenizer, prompt, max_prompt_len=self.max_prompt_len)
        env = await self.environments.create()
        # The templated prompt is the first observation; what reset() returns is ignored.
        await self._call(env.reset, prompt, label, what=f"{where}: reset()")
        tokens, mask, logprobs = list(prompt_ids), [0] * len(prompt_ids), [0.0] * len(prompt_ids)
        turn_rewards: list[float] = []
        turn_ends: list[int] = []
        progress.streams = (tokens, mask, logprobs, len(prompt_ids))  # appended to in place
        metrics: dict[str, float] = {}
        sampling = self.sampling
        env_seed = False  # the environment chose the seed of its turns (a sampling override)
        finish: FinishReason = "stop"
        truncated, score, weight_version = True, None, None
        for turn in range(self.max_turns):
            room = self.max_len - len(tokens)
            if room < 1:
                break
            params = sampling.replace(max_new_tokens=min(sampling.max_new_tokens, room))
            if not env_seed:
                params = seeded(params, seed, prompt_index, sample_index, turn)
            generation = await self.generator.generate(tokens, params)
            finish, weight_version = generation.finish_reason, generation.weight_version
            tokens += generation.token_ids
            mask += [1] * len(generation.token_ids)
            logprobs += generation.logprobs
            action_text = self.tokenizer.decode(
                list(generation.token_ids), skip_special_tokens=True
            )
            raw = await self._call(env.step, action_text, what=f"{where}: step() on turn {turn}")
            result = coerce_step_result(raw, source=f"{where}, turn {turn}")
            turn_rewards.append(float(result.reward))
            turn_ends.append(len(tokens) - 1)  # a generation holds at least one token
            for key, value in result.metrics.items():
                metrics[key] = float(value)
            if result.score is not None:
                score = float(result.score)
            if result.done:
                truncated = False
                break
            if turn + 1 == self.max_turns:
                break  # no turn left to answer feedback: truncated, without a dangling user turn
            feedback_ids = self.turns.feedback_ids(generation.token_ids, result.feedback)
            if len(tokens) + len(feedback_ids) >= self.max_len:
                break  # no room for the feedback and another turn: truncated
            tokens += feedback_ids
            mask += [0] * len(feedback_ids)
            logprobs += [0.0] * len(feedback_ids)
            if result.sampling:
                try:
                    sampling = self.sampling.replace(**result.sampling)
                    env_seed = result.sampling.get("seed") is not None
                except (TypeError, ValueError) as exc:
                    raise EnvironmentStepError(
                        f"{where}, turn {turn}: bad sampling override: {exc}"
                    ) from None
        total = sum(turn_rewards)
        metrics["env/turns"] = float(len(turn_rewards))
        return Trajectory(
            token_ids=tuple(tokens),
            action_mask=tuple(mask),
            rollout_logprobs=tuple(logprobs),
            prompt_length=len(prompt_ids),
            reward=total,
            turn_rewards=tuple(turn_rewards),
            turn_ends=tuple(turn_ends),
            score=total if score is None else score,
            truncated=truncated,
            finish_reason=finish,
            metrics=metrics,
            prompt_index=prompt_index,
            sample_index=sample_index,
            weight_version=weight_version,
        )

    async def _guarded(
        self, prompt: str, label: object, prompt_index: int, sample_index: int, seed: int | None
    ) -> tuple[Trajectory | None, str, str]:
        """An episode under the failure policy: ``(trajectory or None, "" | "skipped" |
        "fallback", the failure's message or "")``."""
        progress = _Progress()
        try:
            episode = await self._episode(prompt, label, prompt_index, sample_index, seed, progress)
            return episode, "", ""
        except EnvironmentStepError as exc:
            if self.policy.on_failure == "raise":
                raise
            if self.policy.on_failure == "fallback" and progress.acted:
                reward = self.policy.fallback_reward
                return progress.ended(reward, prompt_index, sample_index), "fallback", str(exc)
            return None, "skipped", str(exc)

    async def _call(self, method: Callable[..., object], *args: object, what: str) -> object:
        """An environment method under ``step_timeout_s``; its failures name ``what``."""
        run = (
            method(*args)
            if inspect.iscoroutinefunction(method)
            else in_daemon_thread(method, *args)
        )
        try:
            return await maybe_await(await asyncio.wait_for(run, self.step_timeout_s))
        except TimeoutError:
            raise EnvironmentStepError(
                f"{what} did not return within {self.step_timeout_s} s (step_timeout_s)"
            ) from None
        except Exception as exc:
            where = user_traceback(exc)
            raise EnvironmentStepError(
                f"{what} raised {exc!r}" + (f"\n{where}" if where else "")
            ) from exc

    async def run(
        self,
        *,
        prompts: Sequence[str],
        labels: Sequence[object],
        n_samples_per_prompt: int = 1,
        prompt_indices: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> ExecutorResult:
        """Run every episode concurrently; see `ExecutorResult`.

        ``seed``: when set, turn ``t`` of sample ``s`` of the prompt at index ``i`` is drawn with
        seed ``request_seed(seed, i, s, t)`` (unless the environment's sampling override names
        a seed of its own).
        """
        indices = batch_indices(
            prompts,
            labels,
            n_samples_per_prompt=n_samples_per_prompt,
            prompt_indices=prompt_indices,
        )
        outcomes = await gather_or_cancel(
            self._guarded(prompts[p], labels[p], indices[p], s, seed)
            for p in range(len(prompts))
            for s in range(n_samples_per_prompt)
        )
        episodes = [t for t, _, _ in outcomes if t is not None]
        n = max(len(episodes), 1)
        failures = [how for _, how, _ in outcomes if how]
        failure = next((message for _, _, message in outcomes if message), "")
        metrics = {
            "env/failed": float(len(failures)),
            "env/skipped": float(failures.count("skipped")),
            "env/fallback": float(failures.count("fallback")),
            "rollout/samples": float(len(episodes)),
            "rollout/truncated_frac": sum(e.truncated for e in episodes) / n,
            "rollout/response_length_mean": sum(e.response_length for e in episodes) / n,
            "env/turns_max": max((e.metrics["env/turns"] for e in episodes), default=0.0),
            **_episode_means(episodes),
        }
        return ExecutorResult(trajectories=list(episodes), metrics=metrics, failure=failure)


class _Progress:
    """What an episode has produced so far (the lists its loop appends to), so that one that
    fails can still end as a fallback trajectory."""

    def __init__(self) -> None:
        self.streams: tuple[list[int], list[int], list[float], int] | None = None

    @property
    def acted(self) -> bool:
        """The policy produced at least one token."""
        return self.streams is not None and any(self.streams[1])

    def ended(self, reward: float, prompt_index: int, sample_index: int) -> Trajectory:
        """The episode cut where it failed, scored ``reward`` (one turn: its last action)."""
        assert self.streams is not None
        tokens, mask, logprobs, prompt_length = self.streams
        last = max(i for i, m in enumerate(mask) if m)
        turns = sum(1 for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1]))
        return Trajectory(
            token_ids=tuple(tokens),
            action_mask=tuple(mask),
            rollout_logprobs=tuple(logprobs),
            prompt_length=prompt_length,
            reward=reward,
            turn_rewards=(reward,),
            turn_ends=(last,),
            score=reward,
            truncated=True,
            finish_reason="abort",
            metrics={"env/turns": float(turns)},
            prompt_index=prompt_index,
            sample_index=sample_index,
        )


def _episode_means(episodes: Sequence[Trajectory]) -> dict[str, float]:
    """``env/<key>_mean`` of every metric the episodes report (over those that report it):
    ``env/turns_mean`` and whatever the environment's steps returned."""
    values: dict[str, list[float]] = {}
    for e in episodes:
        for key, value in e.metrics.items():
            values.setdefault(key, []).append(value)
    return {
        f"{key if key.startswith('env/') else 'env/' + key}_mean": sum(v) / len(v)
        for key, v in values.items()
    }
