"""The kinds of row the OpenRLHF tables hold (`Same`, `Alias`, `Gathered`, `Notice`,
`Refused`), the arity of a flag, and the value translations the rows share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from rlhf.cli.config import ConfigError

Arity = Literal["switch", "one", "two", "many"]
"""Values an OpenRLHF flag takes: ``switch`` (bare, or one of True/False), ``one``, ``two``
or ``many`` (one or more, up to the next ``--flag``)."""

SWITCH_VALUES = {"true": "True", "1": "True", "yes": "True", "false": "False", "0": "False"}
"""A switch's optional value (any case) → the boolean it means."""


@dataclass(frozen=True)
class Same:
    """OpenRLHF's spelling is our field's; ``default`` says where its default differs."""

    default: str = ""


@dataclass(frozen=True)
class Alias:
    """The flag sets ``fields`` (each to the same values).

    ``values`` translates OpenRLHF's values into ours: a mapping of the accepted values (any
    other is refused, naming them), or a function of the value list. ``default`` says where
    our default differs from OpenRLHF's, and why."""

    fields: tuple[str, ...]
    values: Mapping[str, str] | Callable[[list[str]], list[str]] | None = None
    default: str = ""


@dataclass(frozen=True)
class Gathered:
    """The flag is one input of ``group`` (a setting several flags make together; see
    `FINISHERS`)."""

    group: str
    default: str = ""


@dataclass(frozen=True)
class Notice:
    """Accepted; ``message`` (printed to stderr) says why nothing needs to happen here."""

    message: str


@dataclass(frozen=True)
class Refused:
    """An error: ``message`` says what to use instead."""

    message: str


Entry = Same | Alias | Gathered | Notice | Refused


@dataclass(frozen=True)
class Row:
    """One OpenRLHF flag (``name`` without its ``--``)."""

    name: str
    arity: Arity
    entry: Entry


NOTE = "\0note:"
"""Prefix of the token a finisher returns for a printed note (never a flag: `translate` takes
it out of the line)."""


def alias(
    *fields: str,
    values: Mapping[str, str] | Callable[[list[str]], list[str]] | None = None,
    default: str = "",
) -> Alias:
    return Alias(tuple(fields), values, default)


def comma_list(values: list[str]) -> list[str]:
    """``"0.5,0.5"`` (OpenRLHF's comma-separated weights) → ``["0.5", "0.5"]``."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def never_at_minus_one(values: list[str]) -> list[str]:
    """OpenRLHF's ``-1`` (never) → ``0``."""
    return ["0"] if values == ["-1"] else values


def steps_from_zero(values: list[str]) -> list[str]:
    """OpenRLHF's step count from 0 (``N`` covers steps 0..N; -1 none) → a count: ``N + 1``."""
    (value,) = values
    try:
        count = int(value)
    except ValueError:
        raise ConfigError(f"takes a whole number of steps, got {value!r}") from None
    return [str(max(count + 1, 0))]


def all_linear(values: list[str]) -> list[str]:
    """peft's ``all-linear`` → the projections of a Llama/Qwen-shaped block (our default)."""
    if values == ["all-linear"]:
        return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return values


def pair_from_one_or_two(values: list[str]) -> list[str]:
    """OpenRLHF's ``LOW HIGH`` or a single ``HIGH`` (lower bound 0) → ``LOW HIGH``."""
    if len(values) == 1:
        return ["0", values[0]]
    if len(values) == 2:
        return values
    raise ConfigError(f"takes LOW HIGH or a single HIGH, got {' '.join(values)}")


DTYPE_BF16 = {"bf16": "True"}


MUON_NESTEROV = (
    "Muon's momentum is Nesterov's here (DeepSpeed's built-in Muon and molt's alike; in "
    "OpenRLHF the flag is a placeholder too)"
)
MUON_NS_STEPS = (
    "Muon runs 5 Newton-Schulz steps here (DeepSpeed's and molt's alike; OpenRLHF's flag is "
    "a placeholder there too)"
)


IMAGES = Refused(
    "vision-language training is not built yet (issue 45 builds the image flags); "
    "prompts are text here"
)
SCORERS = (
    "the reference and the reward model run as one data-parallel replica here (their "
    "tensor x context-parallel ranks), scoring every sample; OpenRLHF's GPU count for them "
    "sets only how many replicas share that work"
)
HEAD_STRIDE = (
    "ring attention here passes every head at once (the stride trades memory for "
    "communication; the results are the same)"
)
NORMALIZE = (
    "OpenRLHF normalises with the mean and std a reward model stored when it was trained "
    "with --reward.normalize_enable; rlhf train rm stores none, so the scores are used as "
    "they are (what OpenRLHF does for such a model)"
)
MOE = Refused("MoE training is not built yet (issue 45 builds it); leave the flag out")


SCHEDULES = {
    "cosine_with_min_lr": "cosine",
    "cosine": "cosine",
    "linear": "linear",
    "constant": "constant",
    "constant_with_warmup": "constant",
}
"""OpenRLHF's (transformers') scheduler names → ours (warmup is separate here)."""


def best_metric(values: list[str]) -> list[str]:
    """OpenRLHF's ``eval_<source>_pass1`` → ``eval/<source>/pass@1`` (others unchanged)."""
    (value,) = values
    if value.startswith("eval_") and value.endswith(("_pass1", "_pass@1")):
        source = value[len("eval_") :].rsplit("_pass", 1)[0]
        return [f"eval/{source}/pass@1"]
    return [value]


def only(flag: str, value: str, why: str) -> Alias:
    """A flag accepted only at ``value`` (OpenRLHF's default): anything else is refused."""
    return Alias((), values=OnlyValue(flag, value, why))


def off(flag: str, why: str) -> Alias:
    """A switch accepted only when off."""
    return only(flag, "False", why)


@dataclass(frozen=True)
class OnlyValue:
    flag: str
    value: str
    why: str

    def __call__(self, values: list[str]) -> list[str]:
        given = " ".join(values)
        given_number = number(given)
        same = given.lower() == self.value.lower() or (
            given_number is not None and given_number == number(self.value)
        )
        if not same:
            raise ConfigError(f"--{self.flag} {given}: {self.why}; leave the flag out")
        return []


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


# Finishers: a group's flags (name → values) → our tokens.


def switch(values: list[str]) -> str:
    return SWITCH_VALUES.get(values[0].lower(), values[0]) if values else "True"
