"""Single-turn reward functions: the `RewardScorer` protocol, a loader for the user's Python file,
output validation and failure policies.

A reward file defines ``reward_func(queries, prompts, labels, **kwargs)`` (sync or async), called
once per batch, returning either a sequence (or tensor) of rewards, or a dict with ``rewards`` and
optional ``scores`` and ``extra_logs`` (OpenRLHF's format). ``kwargs`` carries ``responses`` (the
decoded completions alone) and anything the caller adds.

Failure policy (`FailurePolicy`): ``raise`` (default) stops with a message naming the file, the
sample and what was expected; ``skip`` drops the failing samples and counts them in
``reward/failed``; ``fallback`` gives them a fixed reward and counts them in ``reward/fallback``.
When a whole batch call fails under ``skip`` or ``fallback``, the samples are retried one by one
so that only the culprits are dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeGuard, runtime_checkable

from rlhf.agents._aio import in_daemon_thread
from rlhf.agents.loading import load_symbol, user_traceback
from rlhf.agents.types import finite_float

FailureMode = Literal["raise", "skip", "fallback"]


class RewardError(RuntimeError):
    """A reward could not be computed and the failure policy is ``raise``."""


@dataclass(frozen=True)
class FailurePolicy:
    """What happens to a sample whose reward cannot be computed.

    Attributes:
        on_failure: ``raise``, ``skip`` or ``fallback``.
        fallback_reward: Reward given under ``fallback``.
    """

    on_failure: FailureMode = "raise"
    fallback_reward: float = 0.0

    def __post_init__(self) -> None:
        if self.on_failure not in ("raise", "skip", "fallback"):
            raise ValueError(
                f"reward failure policy must be raise, skip or fallback, got {self.on_failure!r}"
            )
        if not math.isfinite(self.fallback_reward):
            raise ValueError(f"fallback_reward must be finite, got {self.fallback_reward}")


@dataclass
class RewardBatch:
    """Rewards for a batch; ``valid[i]`` is False for samples dropped by the ``skip`` policy.

    Attributes:
        rewards: One finite float per sample (0.0 placeholder where not valid).
        scores: One finite float per sample (defaults to the reward).
        valid: Whether sample i has a usable reward.
        extra_logs: Per-sample extra values from the reward function, by name.
        metrics: Counts of failures by kind.
    """

    rewards: list[float]
    scores: list[float]
    valid: list[bool]
    extra_logs: dict[str, list[float]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class RewardScorer(Protocol):
    """Scores a batch of completed samples."""

    async def score(
        self,
        *,
        queries: Sequence[str],
        prompts: Sequence[str],
        labels: Sequence[object],
        **kwargs: object,
    ) -> RewardBatch: ...


@runtime_checkable
class _ToList(Protocol):
    """A tensor or array: its entries as Python values from ``tolist()``."""

    def tolist(self) -> object: ...


def _as_list(value: object, *, what: str, n: int, source: str) -> list[object]:
    if isinstance(value, _ToList):
        value = value.tolist()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise RewardError(
            f"{source}: {what} must be a sequence of {n} numbers, got {type(value).__name__}"
        )
    if len(value) != n:
        raise RewardError(f"{source}: {what} has {len(value)} entries for a batch of {n} samples")
    return list(value)


def _number(value: object) -> float | None:
    """A finite float, or None for anything that is not one."""
    return finite_float(value)


@dataclass
class _Parsed:
    rewards: list[float | None]
    scores: list[float | None]
    extra_logs: dict[str, list[float]]


def parse_reward_output(output: object, *, n: int, source: str) -> _Parsed:
    """Validate a reward function's (or server's) output for a batch of ``n`` samples.

    Structural problems (wrong type, wrong length, missing ``rewards``) raise `RewardError`;
    a non-finite or non-numeric entry becomes None for that sample only.
    """
    if isinstance(output, dict):
        if "rewards" not in output:
            raise RewardError(
                f"{source}: the returned dict has no 'rewards' key (keys: {sorted(output)})"
            )
        rewards = _as_list(output["rewards"], what="'rewards'", n=n, source=source)
        raw_scores = output.get("scores")
        scores = (
            rewards
            if raw_scores is None
            else _as_list(raw_scores, what="'scores'", n=n, source=source)
        )
        extra: dict[str, list[float]] = {}
        raw_extra = output.get("extra_logs") or {}
        if not isinstance(raw_extra, dict):
            raise RewardError(
                f"{source}: 'extra_logs' must be a dict of name -> values, "
                f"got {type(raw_extra).__name__}"
            )
        for name, values in raw_extra.items():
            if _number(values) is not None:
                extra[str(name)] = [float(values)] * n
            else:
                items = _as_list(values, what=f"extra_logs[{name!r}]", n=n, source=source)
                extra[str(name)] = [v if (v := _number(x)) is not None else math.nan for x in items]
    else:
        rewards = _as_list(output, what="the returned rewards", n=n, source=source)
        scores, extra = rewards, {}
    return _Parsed([_number(r) for r in rewards], [_number(s) for s in scores], extra)


def describe_bad_value(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


class PolicyApplier:
    """Turns per-sample results into a `RewardBatch` under a `FailurePolicy`."""

    def __init__(self, policy: FailurePolicy, source: str) -> None:
        self.policy = policy
        self.source = source

    def fail(self, batch: RewardBatch, index: int, reason: str) -> None:
        """Record that sample ``index`` has no reward, or raise under ``raise``."""
        if self.policy.on_failure == "raise":
            raise RewardError(f"{self.source}: sample {index}: {reason}")
        if self.policy.on_failure == "skip":
            batch.valid[index] = False
            batch.metrics["reward/failed"] = batch.metrics.get("reward/failed", 0.0) + 1
        else:
            batch.rewards[index] = batch.scores[index] = self.policy.fallback_reward
            batch.metrics["reward/fallback"] = batch.metrics.get("reward/fallback", 0.0) + 1


def new_batch(
    queries: Sequence[str], prompts: Sequence[str], labels: Sequence[object]
) -> RewardBatch:
    """An all-valid placeholder batch, after checking the three inputs have one entry per sample."""
    n = len(queries)
    if len(prompts) != n or len(labels) != n:
        raise ValueError(
            "queries, prompts and labels must have one entry per sample, got "
            f"{n}, {len(prompts)} and {len(labels)}"
        )
    return RewardBatch(rewards=[0.0] * n, scores=[0.0] * n, valid=[True] * n)


def fill(
    batch: RewardBatch, offset: int, parsed: _Parsed, applier: PolicyApplier, raw: Any
) -> None:
    """Copy ``parsed`` into ``batch`` at ``offset``, applying the policy to bad entries.

    ``raw`` is the output ``parsed`` came from, as returned (a sequence, tensor or array of
    rewards, or a dict holding one): a bad entry is named as it was returned, indexed there."""
    for i, (r, s) in enumerate(zip(parsed.rewards, parsed.scores, strict=True)):
        j = offset + i
        if r is None:
            value = raw["rewards"][i] if isinstance(raw, dict) else raw[i]
            applier.fail(batch, j, f"reward {describe_bad_value(value)} is not a finite number")
            continue
        batch.rewards[j] = r
        batch.scores[j] = r if s is None else s
    for name, values in parsed.extra_logs.items():
        column = batch.extra_logs.setdefault(name, [math.nan] * len(batch.rewards))
        column[offset : offset + len(values)] = values


class FunctionReward:
    """A `RewardScorer` backed by a Python callable ``reward_func(queries, prompts, labels, **kw)``.

    Args:
        func: The reward function, sync or async. Sync functions run in a worker thread so they
            never block the event loop; one `score` call makes its calls one after another, but
            concurrent `score` calls (or a call abandoned after ``timeout_s``) can overlap.
        source: Name used in error messages (the file path for `from_file`).
        policy: Failure policy.
        batch_size: Largest batch per call; None passes the whole batch at once.
        timeout_s: Deadline of one call; a call past it is a failure under the policy. A sync
            function cannot be interrupted: its thread finishes in the background.
    """

    def __init__(
        self,
        func: Callable[..., object],
        *,
        source: str = "reward function",
        policy: FailurePolicy | None = None,
        batch_size: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if not callable(func):
            raise TypeError(f"{source}: reward_func must be callable, got {type(func).__name__}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.func = func
        self.source = source
        self.applier = PolicyApplier(policy or FailurePolicy(), source)
        self.batch_size = batch_size
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self.timeout_s = timeout_s

    @classmethod
    def from_file(
        cls,
        path: str,
        *,
        symbol: str = "reward_func",
        policy: FailurePolicy | None = None,
        batch_size: int | None = None,
        timeout_s: float | None = None,
    ) -> FunctionReward:
        """Load ``symbol`` from the Python file at ``path``."""
        func = load_symbol(path, symbol, purpose="reward function")
        source = f"reward function {symbol} in {path}"
        return cls(func, source=source, policy=policy, batch_size=batch_size, timeout_s=timeout_s)

    @classmethod
    def from_spec(
        cls, spec: str, *, policy: FailurePolicy | None = None, timeout_s: float | None = None
    ) -> FunctionReward:
        """``builtin:<name>`` (`rlhf.agents.builtin_rewards`) or the path of a Python file
        defining ``reward_func`` (`from_file`).

        Raises:
            ValueError: an unknown builtin, naming the known ones.
            OSError, ImportError, AttributeError: the file is missing, fails to import or
                defines no ``reward_func`` (`rlhf.agents.load_symbol`).
        """
        from rlhf.agents import builtin_rewards

        if not spec.startswith("builtin:"):
            return cls.from_file(spec, policy=policy, timeout_s=timeout_s)
        name = spec.removeprefix("builtin:")
        if name not in builtin_rewards.NAMES:
            known = ", ".join(f"builtin:{n}" for n in builtin_rewards.NAMES)
            raise ValueError(f"{spec}: no such builtin; use {known}, or a Python file")
        func = getattr(builtin_rewards, name)
        return cls(func, source=spec, policy=policy, timeout_s=timeout_s)

    async def _call(
        self,
        queries: list[str],
        prompts: list[str],
        labels: list[object],
        kwargs: Mapping[str, object],
    ) -> object:
        if inspect.iscoroutinefunction(self.func):
            return await self.func(queries, prompts, labels, **kwargs)
        result = await in_daemon_thread(self.func, queries, prompts, labels, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def _score_slice(
        self,
        batch: RewardBatch,
        lo: int,
        hi: int,
        queries: Sequence[str],
        prompts: Sequence[str],
        labels: Sequence[object],
        kwargs: Mapping[str, object],
    ) -> None:
        sub_kwargs = {
            k: (v[lo:hi] if _is_per_sample(v, len(queries)) else v) for k, v in kwargs.items()
        }
        args = (list(queries[lo:hi]), list(prompts[lo:hi]), list(labels[lo:hi]))
        try:
            try:
                raw = await asyncio.wait_for(self._call(*args, sub_kwargs), self.timeout_s)
            except TimeoutError:
                raise RewardError(
                    f"{self.source} did not return within {self.timeout_s} s "
                    f"(reward.timeout_s) on samples {lo}..{hi - 1}"
                ) from None
            parsed = parse_reward_output(raw, n=hi - lo, source=self.source)
        except Exception as exc:
            if self.applier.policy.on_failure == "raise":
                if isinstance(exc, RewardError):
                    raise
                where = user_traceback(exc)
                raise RewardError(
                    f"{self.source} raised on samples {lo}..{hi - 1}: {exc!r}"
                    + (f"\n{where}" if where else "")
                ) from exc
            if hi - lo > 1:  # isolate the culprits one sample at a time
                for i in range(lo, hi):
                    await self._score_slice(batch, i, i + 1, queries, prompts, labels, kwargs)
                return
            self.applier.fail(batch, lo, f"reward function failed: {exc!r}")
            return
        fill(batch, lo, parsed, self.applier, raw)

    async def score(
        self,
        *,
        queries: Sequence[str],
        prompts: Sequence[str],
        labels: Sequence[object],
        **kwargs: object,
    ) -> RewardBatch:
        """Score a batch; see the module docstring for formats and failure policies."""
        batch = new_batch(queries, prompts, labels)
        n = len(queries)
        step = self.batch_size or max(n, 1)
        for lo in range(0, n, step):
            await self._score_slice(batch, lo, min(lo + step, n), queries, prompts, labels, kwargs)
        return batch


def _is_per_sample(value: object, n: int) -> TypeGuard[list[object] | tuple[object, ...]]:
    return isinstance(value, list | tuple) and len(value) == n
