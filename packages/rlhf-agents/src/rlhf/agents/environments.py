"""Multi-turn environments: the protocol, `StepResult`, and loading a user's environment class.

An environment file defines a class (default name ``Environment``) whose instances hold one
episode's state: ``reset(prompt, label)`` then ``step(action_text)`` until ``done``. The templated
prompt is the first observation; a value returned by ``reset`` is ignored. Both may be
coroutines. A new instance is made per sample, with ``env_kwargs`` as keyword arguments; an
``async def create(**kwargs)`` classmethod, when present, is awaited instead of the constructor
(a constructor cannot itself be a coroutine, so ``async def __init__`` is refused with that hint).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

from rlhf.agents.loading import load_symbol
from rlhf.agents.types import finite_float


@dataclass(frozen=True)
class StepResult:
    """What the environment says after one policy turn.

    Attributes:
        feedback: Text shown to the policy as the next user turn (ignored when ``done``).
        reward: Reward of this turn.
        done: The episode is over.
        score: Optional final score (for filtering and pass@k); defaults to the total reward.
        metrics: Scalar diagnostics, averaged over the batch by the executor.
        sampling: Overrides of the sampling parameters for the next turn (e.g. max_new_tokens).
    """

    feedback: str = ""
    reward: float = 0.0
    done: bool = False
    score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    sampling: dict[str, object] = field(default_factory=dict)


class Environment(Protocol):
    """One episode of a multi-turn task. Either method may be a coroutine function: what they
    return is awaited when awaitable; ``reset``'s value is then ignored, ``step``'s must be a
    `StepResult` or a dict of its fields (`coerce_step_result`)."""

    def reset(self, prompt: str, label: object, /) -> object: ...
    def step(self, action_text: str, /) -> object: ...


EnvironmentClass: TypeAlias = Callable[..., Environment | Awaitable[Environment]]
"""What makes one episode's environment: a class, or any callable returning an instance (or
an awaitable of one)."""


class EnvironmentStepError(RuntimeError):
    """An environment misbehaved (raised, returned the wrong type)."""


async def maybe_await(value: object) -> object:
    return await value if inspect.isawaitable(value) else value


def coerce_step_result(value: object, *, source: str) -> StepResult:
    """Accept a `StepResult` or a dict with its fields; anything else names what was expected.

    Numbers may be Python, numpy or 0-d torch scalars; they come out as floats.
    """
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(StepResult.__dataclass_fields__))
        if unknown:
            raise EnvironmentStepError(f"{source}: step() returned unknown keys {unknown}")
        value = StepResult(**value)
    if not isinstance(value, StepResult):
        raise EnvironmentStepError(
            f"{source}: step() must return a StepResult or a dict of its fields, "
            f"got {type(value).__name__}"
        )

    def bad(field_name: str, expected: str, got: object) -> EnvironmentStepError:
        return EnvironmentStepError(
            f"{source}: StepResult.{field_name} must be {expected}, got {got!r}"
        )

    if not isinstance(value.feedback, str):
        raise bad("feedback", "str", type(value.feedback).__name__)
    if not isinstance(value.done, bool):
        raise bad("done", "bool", value.done)
    reward = finite_float(value.reward)
    if reward is None:
        raise bad("reward", "a finite number", value.reward)
    score = None if value.score is None else finite_float(value.score)
    if value.score is not None and score is None:
        raise bad("score", "a finite number or None", value.score)
    if not isinstance(value.metrics, dict):
        raise bad("metrics", "a dict of numbers", value.metrics)
    metrics = {}
    for key, number in value.metrics.items():
        metric = finite_float(number)
        if metric is None:
            raise bad(f"metrics[{key!r}]", "a finite number", number)
        metrics[str(key)] = metric
    if not isinstance(value.sampling, dict):
        raise bad("sampling", "a dict of sampling overrides", value.sampling)
    return dataclasses.replace(value, reward=reward, score=score, metrics=metrics)


def _check_construction(
    cls: EnvironmentClass, kwargs: Mapping[str, object], *, source: str
) -> None:
    """A `TypeError` naming ``source`` when an instance cannot be made from ``kwargs`` alone
    (a constructor, or async ``create``, with a parameter that has no default)."""
    create = getattr(cls, "create", None)
    maker = create if create is not None and inspect.iscoroutinefunction(create) else cls
    try:
        signature = inspect.signature(maker)
    except (TypeError, ValueError):  # a builtin or C type: nothing to read
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        name = "create" if maker is create else "__init__"
        raise TypeError(
            f"{source}: {name}{signature} cannot be called as the executor calls it, once per "
            f"sample with {sorted(kwargs) or 'no arguments'} ({exc}); give its parameters "
            "defaults"
        ) from None


class EnvironmentFactory:
    """Makes a fresh environment instance per sample.

    Args:
        cls: The environment class (or any callable returning an instance).
        env_kwargs: Keyword arguments for every instance.
        source: Name used in error messages.
    """

    def __init__(
        self,
        cls: EnvironmentClass,
        *,
        env_kwargs: Mapping[str, object] | None = None,
        source: str = "environment",
    ) -> None:
        if inspect.iscoroutinefunction(getattr(cls, "__init__", None)):
            raise TypeError(
                f"{source}: __init__ cannot be a coroutine; do async set-up in an "
                "`async def create(cls, **kwargs)` classmethod instead"
            )
        for method in ("reset", "step"):
            if not callable(getattr(cls, method, None)):
                raise TypeError(f"{source}: the environment class must define {method}()")
        _check_construction(cls, env_kwargs or {}, source=source)
        self.cls = cls
        self.env_kwargs = dict(env_kwargs or {})
        self.source = source

    @classmethod
    def from_file(
        cls,
        path: str,
        *,
        symbol: str = "Environment",
        env_kwargs: Mapping[str, object] | None = None,
    ) -> EnvironmentFactory:
        """Load the environment class ``symbol`` from the Python file at ``path``."""
        env_cls = load_symbol(path, symbol, purpose="environment")
        return cls(env_cls, env_kwargs=env_kwargs, source=f"environment {symbol} in {path}")

    async def create(self) -> Environment:
        """A new instance (awaiting ``create`` when the class defines it as a coroutine)."""
        create = getattr(self.cls, "create", None)
        if create is not None and inspect.iscoroutinefunction(create):
            return await create(**self.env_kwargs)
        made = self.cls(**self.env_kwargs)
        return await made if inspect.isawaitable(made) else made
