"""OpenRLHF 0.11's agent-file contract, run token-in-token-out on our generators.

An OpenRLHF agent file runs here with one line changed, its import
(``from rlhf.agents.openrlhf import AgentInstanceBase, MultiTurnAgentExecutor``):

- ``AgentInstance(AgentInstanceBase)``: ``async reset(states)`` gets ``{"observation": prompt,
  "label": label}`` and returns ``{"observation": text}``; ``async step(states)`` gets
  ``{"observation_text", "action_text", "label", "sampling_params"}`` and returns a dict with
  ``rewards`` (a number or 0-d tensor), ``environment_feedback`` (text appended as tokens),
  ``done``, and optionally ``scores`` (what dynamic filtering and pass@k read; default the
  summed rewards), ``sampling_params`` (the next turn's) and ``extra_logs`` (logged as
  ``env/<key>_mean``);
- ``AgentExecutor(MultiTurnAgentExecutor)`` with ``super().__init__(AgentInstance)``, or any
  ``AgentExecutorBase`` whose ``async execute(prompt, label, sampling_params, max_length,
  hf_tokenizer, llm_engine, images=None)`` returns OpenRLHF's episode dict
  (``observation_tokens``, ``action_ranges``, ``rollout_log_probs``, ``reward``, ``scores``,
  ``extra_logs``, ``truncated``).

`OpenRLHFAgentRunner` is the executor a run uses for such a file: it calls ``execute`` once
per sample with an `EngineAdapter` over our `Generator` as ``llm_engine`` (``generate(token_ids,
sampling_params)`` answering in vLLM's ``RequestOutput`` shape) and turns each episode into a
`Trajectory` (action tokens from ``action_ranges``, the engine's log-probs kept exactly).

OpenRLHF's OpenAI-server executor shape works too: an executor that keeps the first
``llm_engine`` it is given and calls it from its own HTTP server's thread (another event loop)
gets its generations run on the runner's loop, and each episode's weight version is then the
oldest of the generations made while it ran (which call was its own cannot be told apart there).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import inspect
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict, TypeVar

from rlhf.agents._aio import gather_or_cancel
from rlhf.agents.environments import EnvironmentStepError
from rlhf.agents.loading import user_traceback
from rlhf.agents.rewards import FailurePolicy
from rlhf.agents.seeds import request_seed
from rlhf.agents.single_turn import ExecutorResult, batch_indices
from rlhf.agents.tokens import CallableTokenizer, Tokenizer
from rlhf.agents.types import Generator, SamplingParams, Trajectory, finite_float

T = TypeVar("T")


class VLLMSamplingParams(Protocol):
    """Sampling parameters in vLLM's shape, as an agent hands them to ``llm_engine.generate``
    (`OpenRLHFSamplingParams`, vLLM's ``SamplingParams``, any object with these attributes):
    ``max_tokens`` is read, and set before each turn by `MultiTurnAgentExecutor`;
    ``temperature``, ``top_p``, ``top_k``, ``stop``, ``stop_token_ids`` and ``seed`` are read
    where present."""

    max_tokens: int | None


@dataclass
class OpenRLHFSamplingParams:
    """The mutable sampling parameters an OpenRLHF agent sees (vLLM's attribute names); an
    agent's step may change them or return new ones (any object with these attributes,
    vLLM's ``SamplingParams`` included)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = 1

    @classmethod
    def of(cls, sampling: SamplingParams) -> OpenRLHFSamplingParams:
        return cls(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop=list(sampling.stop),
            stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.seed,
        )


def ours(params: VLLMSamplingParams) -> SamplingParams:
    """An OpenRLHF/vLLM sampling-parameters object as our `SamplingParams`."""
    if params.max_tokens is None:
        raise TypeError("sampling_params.max_tokens is None: a generation needs a token budget")
    stop = getattr(params, "stop", None) or ()
    return SamplingParams(
        max_new_tokens=int(params.max_tokens),
        temperature=float(getattr(params, "temperature", 1.0)),
        top_p=float(getattr(params, "top_p", 1.0)),
        top_k=int(getattr(params, "top_k", -1) or -1),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(getattr(params, "stop_token_ids", None) or ()),
        seed=getattr(params, "seed", None),
    )


@dataclass(frozen=True)
class Logprob:
    """vLLM's per-token log-prob entry (``.logprob``)."""

    logprob: float


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's ``CompletionOutput`` fields an agent reads."""

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict[int, Logprob]]


@dataclass(frozen=True)
class RequestOutput:
    """vLLM's ``RequestOutput``: one completion in ``outputs``."""

    outputs: list[CompletionOutput]


@dataclass(eq=False)
class _Calls:
    """The generations made while one episode ran: ``own`` in its task (exact), ``seen`` from
    another thread's loop (anyone's)."""

    own: list[tuple[int | None, str]] = field(default_factory=list)
    seen: list[tuple[int | None, str]] = field(default_factory=list)


class LLMEngine(Protocol):
    """``llm_engine`` as an OpenRLHF executor calls it (`EngineAdapter`)."""

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: VLLMSamplingParams,
        multi_modal_data: object = None,
    ) -> RequestOutput: ...


class Episode(TypedDict):
    """OpenRLHF's episode dict, as `MultiTurnAgentExecutor` returns it; `OpenRLHFAgentRunner`
    reads ``observation_tokens``, ``action_ranges``, ``rollout_log_probs``, ``reward``,
    ``scores``, ``extra_logs`` and ``truncated`` of any executor's."""

    prompt: str
    label: object
    reward: float
    scores: object
    observation_tokens: list[int]
    action_ranges: list[tuple[int, int]]
    rollout_log_probs: list[float]
    truncated: bool
    extra_logs: Mapping[str, object]


_EPISODE: contextvars.ContextVar[_Calls | None] = contextvars.ContextVar(
    "openrlhf_episode", default=None
)


class EngineAdapter:
    """``llm_engine`` for an OpenRLHF executor: our `Generator` behind vLLM's call shape.

    One adapter serves every episode of a runner (an executor may keep the first it gets).
    Called from another thread's event loop (an executor's own HTTP server), a generation is
    run on ``home``, the loop the runner runs on.

    Args:
        generator: Samples in token space.
        tokenizer: Decodes the sampled tokens into ``text``.
    """

    def __init__(self, *, generator: Generator, tokenizer: Tokenizer) -> None:
        self.generator, self.tokenizer = generator, tokenizer
        self.home: asyncio.AbstractEventLoop | None = None
        self.open: list[_Calls] = []

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: VLLMSamplingParams,
        multi_modal_data: object = None,
    ) -> RequestOutput:
        if multi_modal_data:
            raise ValueError("images in agent prompts are not built yet (issue 45)")
        if self.home is not None and asyncio.get_running_loop() is not self.home:
            future = asyncio.run_coroutine_threadsafe(
                self.generate(prompt_token_ids, sampling_params), self.home
            )
            return await asyncio.wrap_future(future)
        generation = await self.generator.generate(list(prompt_token_ids), ours(sampling_params))
        call = (generation.weight_version, generation.finish_reason)
        episode = _EPISODE.get()
        if episode is not None:
            episode.own.append(call)
        else:
            for calls in self.open:
                calls.seen.append(call)
        ids = list(generation.token_ids)
        return RequestOutput(
            outputs=[
                CompletionOutput(
                    token_ids=ids,
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    finish_reason=generation.finish_reason,
                    logprobs=[
                        {t: Logprob(lp)} for t, lp in zip(ids, generation.logprobs, strict=True)
                    ],
                )
            ]
        )


class AgentExecutorBase:
    """OpenRLHF's executor contract: one episode per call, returning OpenRLHF's episode dict
    (see `Episode`)."""

    async def execute(
        self,
        prompt: str,
        label: object,
        sampling_params: OpenRLHFSamplingParams,
        max_length: int,
        hf_tokenizer: CallableTokenizer,
        llm_engine: LLMEngine,
        images: object = None,
    ) -> Mapping[str, Any]:
        raise NotImplementedError("AgentExecutor.execute is not implemented")


class AgentInstanceBase:
    """OpenRLHF's environment contract: ``reset(states)`` and ``step(states)``, both async.

    ``states`` and what the methods return stay OpenRLHF's ``Dict[str, Any]``: their values
    differ by key (text, the label, sampling parameters, numbers or tensors) and are read
    duck-typed, and agent files override these methods with OpenRLHF's annotations."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    async def reset(self, states: dict[str, Any], **kwargs: object) -> dict[str, Any]:
        return states

    async def step(self, states: dict[str, Any], **kwargs: object) -> dict[str, Any]:
        raise NotImplementedError("AgentInstance.step is not implemented")


def _ids(tokenizer: CallableTokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's multi-turn executor over an ``AgentInstanceBase`` class: a fresh instance
    per episode, ``reset`` once, then generate and ``step`` until ``done`` or the token budget
    ``max_length`` is spent; the observation grows by each action's tokens (as sampled) and
    the feedback's tokens (encoded without special tokens).

    ``step_timeout_s`` (set by `OpenRLHFAgentRunner` from the run's step timeout; None: no
    deadline) bounds each ``reset``/``step`` call that awaits: one that does not return in
    time ends the episode with a `TimeoutError` naming the call. (A coroutine that blocks
    the event loop without awaiting cannot be interrupted.)"""

    step_timeout_s: float | None = None

    def __init__(self, agent_instance_cls: type) -> None:
        if not (
            isinstance(agent_instance_cls, type)
            and issubclass(agent_instance_cls, AgentInstanceBase)
        ):
            raise TypeError(
                f"MultiTurnAgentExecutor needs an AgentInstanceBase subclass, got "
                f"{agent_instance_cls!r}"
            )
        self.agent_instance_cls = agent_instance_cls

    async def _within(self, call: Awaitable[T], what: str) -> T:
        return await _deadline(call, self.step_timeout_s, what)

    async def execute(
        self,
        prompt: str,
        label: object,
        sampling_params: VLLMSamplingParams,
        max_length: int,
        hf_tokenizer: CallableTokenizer,
        llm_engine: LLMEngine,
        images: object = None,
    ) -> Episode:
        agent = self.agent_instance_cls()
        reset = await self._within(agent.reset({"observation": prompt, "label": label}), "reset()")
        observation = reset["observation"]
        tokens = _ids(hf_tokenizer, observation)
        room = max_length - (getattr(sampling_params, "max_tokens", None) or 1)
        tokens = tokens[-room:] if len(tokens) > room else tokens
        logprobs = [0.0] * len(tokens)
        ranges: list[tuple[int, int]] = []
        total, scores, extra, truncated = 0.0, None, {}, False
        while True:
            budget = max_length - len(tokens)
            sampling_params.max_tokens = budget
            if budget <= 0:
                break
            out = (await llm_engine.generate(tokens, copy.deepcopy(sampling_params))).outputs[0]
            action = list(out.token_ids)
            truncated = out.finish_reason == "length"
            ranges.append((len(tokens), len(tokens) + len(action)))
            logprobs += [entry[t].logprob for t, entry in zip(action, out.logprobs, strict=True)]
            step = await self._within(
                agent.step(
                    {
                        "observation_text": observation,
                        "action_text": out.text,
                        "label": label,
                        "sampling_params": sampling_params,
                    }
                ),
                f"step() of turn {len(ranges)}",
            )
            total += _number(step["rewards"], what="rewards")
            scores = step.get("scores", total)
            extra = step.get("extra_logs") or {}
            feedback = step["environment_feedback"]
            feedback_ids = _ids(hf_tokenizer, feedback)
            observation = observation + out.text + feedback
            tokens = tokens + action + feedback_ids
            logprobs += [0.0] * len(feedback_ids)
            if step.get("sampling_params") is not None:
                sampling_params = step["sampling_params"]
            if step["done"]:
                break
        return {
            "prompt": prompt,
            "label": label,
            "reward": total,
            "scores": scores,
            "observation_tokens": tokens,
            "action_ranges": ranges,
            "rollout_log_probs": logprobs,
            "truncated": truncated,
            "extra_logs": extra,
        }


async def _deadline(call: Awaitable[T], timeout_s: float | None, what: str) -> T:
    if timeout_s is None:
        return await call
    try:
        return await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        raise TimeoutError(
            f"AgentInstance.{what} did not return within {timeout_s:g} s "
            "(--train.agent_step_timeout_s)"
        ) from None


def _number(value: object, *, what: str) -> float:
    number = finite_float(value)
    if number is None:
        raise ValueError(f"{what} must be a finite number or 0-d tensor, got {value!r}")
    return number


def is_agent_executor(cls: object) -> bool:
    """``cls`` is an OpenRLHF-style executor class (an `AgentExecutorBase` subclass)."""
    return isinstance(cls, type) and issubclass(cls, AgentExecutorBase)


class OpenRLHFAgentRunner:
    """Our executor over an OpenRLHF ``AgentExecutor``: one ``execute`` per sample, each episode
    a `Trajectory`.

    Args:
        executor: The file's ``AgentExecutor()``.
        source: Names the file in errors.
        tokenizer: The policy's tokenizer (``hf_tokenizer``).
        generator: Samples each turn (behind `EngineAdapter`).
        sampling: The run's sampling; ``max_new_tokens`` is the first turn's budget.
        max_len: ``max_length``: the episode's token budget.
        policy: What a failed episode becomes (``raise``, ``skip`` or ``fallback``; a fallback
            episode is skipped here, OpenRLHF's dict being all or nothing).
        step_timeout_s: Deadline of each ``reset``/``step`` of a `MultiTurnAgentExecutor`
            (another executor's ``execute`` generates inside it and has none).
    """

    def __init__(
        self,
        *,
        executor: AgentExecutorBase,
        source: str,
        tokenizer: CallableTokenizer,
        generator: Generator,
        sampling: SamplingParams,
        max_len: int,
        policy: FailurePolicy | None = None,
        step_timeout_s: float | None = None,
    ) -> None:
        if not inspect.iscoroutinefunction(getattr(executor, "execute", None)):
            raise TypeError(f"{source}: AgentExecutor.execute must be an async method")
        self.executor, self.source = executor, source
        self.tokenizer, self.generator = tokenizer, generator
        self.sampling, self.max_len = sampling, max_len
        self.policy = policy or FailurePolicy()
        self.engine = EngineAdapter(generator=generator, tokenizer=tokenizer)
        if isinstance(executor, MultiTurnAgentExecutor):
            executor.step_timeout_s = step_timeout_s

    async def _episode(
        self, prompt: str, label: object, prompt_index: int, sample_index: int, seed: int | None
    ) -> Trajectory | str:
        """The episode's trajectory, or (under a skip/fallback policy) its failure's message."""
        where = f"{self.source} (prompt {prompt_index}, sample {sample_index})"
        params = OpenRLHFSamplingParams.of(self.sampling)
        if seed is not None:
            params.seed = request_seed(seed, prompt_index, sample_index)
        calls = _Calls()
        _EPISODE.set(calls)  # this episode's task only
        self.engine.open.append(calls)
        try:
            out = await self.executor.execute(
                prompt, label, params, self.max_len, self.tokenizer, self.engine
            )
            return _trajectory(out, calls, prompt_index, sample_index)
        except Exception as exc:
            if self.policy.on_failure == "raise":
                frames = user_traceback(exc)
                raise EnvironmentStepError(
                    f"{where}: execute() failed: {exc!r}" + (f"\n{frames}" if frames else "")
                ) from exc
            return f"{where}: execute() failed: {exc!r}"
        finally:
            self.engine.open.remove(calls)

    async def run(
        self,
        *,
        prompts: Sequence[str],
        labels: Sequence[object],
        n_samples_per_prompt: int = 1,
        prompt_indices: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> ExecutorResult:
        """Every episode concurrently; see `ExecutorResult` (``env/<key>_mean`` for each of
        the agents' ``extra_logs``)."""
        self.engine.home = asyncio.get_running_loop()
        indices = batch_indices(
            prompts,
            labels,
            n_samples_per_prompt=n_samples_per_prompt,
            prompt_indices=prompt_indices,
        )
        outcomes = await gather_or_cancel(
            self._episode(prompts[p], labels[p], indices[p], s, seed)
            for p in range(len(prompts))
            for s in range(n_samples_per_prompt)
        )
        episodes = [t for t in outcomes if not isinstance(t, str)]
        failure = next((t for t in outcomes if isinstance(t, str)), "")
        n = max(len(episodes), 1)
        metrics = {
            "env/failed": float(len(outcomes) - len(episodes)),
            "env/skipped": float(len(outcomes) - len(episodes)),
            "rollout/samples": float(len(episodes)),
            "rollout/truncated_frac": sum(e.truncated for e in episodes) / n,
            "rollout/response_length_mean": sum(e.response_length for e in episodes) / n,
        }
        logged: dict[str, list[float]] = {}
        for e in episodes:
            for key, value in e.metrics.items():
                logged.setdefault(key, []).append(value)
        metrics.update({f"env/{k}_mean": sum(v) / len(v) for k, v in logged.items()})
        return ExecutorResult(trajectories=episodes, metrics=metrics, failure=failure)


def _trajectory(
    out: Mapping[str, Any], calls: _Calls, prompt_index: int, sample_index: int
) -> Trajectory:
    """OpenRLHF's episode dict as a `Trajectory` (its reward summed over the episode, on the
    last action token). Its weight version and finish reason are its last generation's; when
    its generations came through the executor's own server, the version is the oldest of those
    made while it ran and the finish reason follows ``truncated``."""
    tokens = [int(t) for t in out["observation_tokens"]]
    ranges = [(int(a), int(b)) for a, b in out["action_ranges"]]
    if not ranges or any(not 0 <= a < b <= len(tokens) for a, b in ranges):
        raise ValueError(f"action_ranges {ranges} do not fit {len(tokens)} observation tokens")
    mask = [0] * len(tokens)
    for a, b in ranges:
        mask[a:b] = [1] * (b - a)
    logprobs = out.get("rollout_log_probs")
    if logprobs is None or len(logprobs) != len(tokens):
        raise ValueError("rollout_log_probs must hold one entry per observation token")
    if out.get("reward") is None:
        raise ValueError(
            "the episode has no reward: return one as the dict's 'reward' (agents score their "
            "own episodes here; no reward model or server scores them)"
        )
    reward = _number(out["reward"], what="reward")
    score = out.get("scores")
    extra = {
        k: _number(v, what=f"extra_logs[{k!r}]") for k, v in (out.get("extra_logs") or {}).items()
    }
    last = ranges[-1][1] - 1
    truncated = bool(out.get("truncated", False))
    if calls.own:
        version, finish = calls.own[-1]
    else:
        known = [v for v, _ in calls.seen if v is not None]
        version, finish = (min(known) if known else None), ("length" if truncated else "stop")
    return Trajectory(
        token_ids=tuple(tokens),
        action_mask=tuple(mask),
        rollout_logprobs=tuple(float(x) * m for x, m in zip(logprobs, mask, strict=True)),
        prompt_length=ranges[0][0],
        reward=reward,
        turn_rewards=(reward,),
        turn_ends=(last,),
        score=reward if score is None else _number(score, what="scores"),
        truncated=truncated,
        finish_reason=finish,  # type: ignore[arg-type]
        metrics={"turns": float(len(ranges)), **extra},
        prompt_index=prompt_index,
        sample_index=sample_index,
        weight_version=version,
    )


__all__ = [
    "AgentExecutorBase",
    "AgentInstanceBase",
    "EngineAdapter",
    "Episode",
    "LLMEngine",
    "MultiTurnAgentExecutor",
    "OpenRLHFAgentRunner",
    "OpenRLHFSamplingParams",
    "RequestOutput",
    "VLLMSamplingParams",
    "is_agent_executor",
]
