"""Command lines rewritten before tyro parses them.

- Bare boolean switches: ``--train.colocate_all`` means ``--train.colocate_all True``. Every
  boolean field of a command's config takes a bare flag (True), as OpenRLHF's ``store_true``
  switches do, and keeps taking ``True``/``False`` (any case) (`bare_switches`).
- Optional sections as plain flags: a field that is a config or None (off by default, such as
  ``algo.rollout_correction``) is a tyro subcommand; ``--algo.rollout_correction.level token``
  anywhere on the line turns it on, its flags moved behind the subcommand's token
  (`plain_sections`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Sequence

_VALUES = {"true": "True", "false": "False"}


@functools.cache
def boolean_flags(cls: type) -> frozenset[str]:
    """The dotted names (``train.colocate_all``) of ``cls``'s boolean fields, nested configs
    included; a field that is ``bool | None`` or ``bool | Literal[...]`` counts."""
    return frozenset(name for name, members in _walk(cls, "") if bool in members)


@functools.cache
def field_flags(cls: type) -> frozenset[str]:
    """The dotted names of every field of ``cls`` (the flags its command takes)."""
    return frozenset(name for name, _ in _walk(cls, ""))


def _walk(cls: type, prefix: str) -> list[tuple[str, list[object]]]:
    hints = typing.get_type_hints(cls)
    names: list[tuple[str, list[object]]] = []
    for f in dataclasses.fields(cls):
        members = _members(hints[f.name])
        nested = [m for m in members if dataclasses.is_dataclass(m) and isinstance(m, type)]
        if not nested:
            names.append((prefix + f.name, members))
        for member in nested:
            names += _walk(member, f"{prefix}{f.name}.")
    return names


def _members(kind: object) -> list[object]:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(kind) for m in _members(arg)]
    return [kind]


def bare_switches(args: Sequence[str], *, cls: type, extra_values: Sequence[str] = ()) -> list[str]:
    """``args`` with every bare boolean flag of ``cls`` given the value True, and ``true`` /
    ``false`` spelled as the parser reads them. ``extra_values`` are other words a boolean
    field may take (``auto`` for ``--ckpt.load_enable``)."""
    flags = boolean_flags(cls)
    out: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        out.append(token)
        i += 1
        if not (token.startswith("--") and "=" not in token and token[2:] in flags):
            continue
        following = args[i] if i < len(args) else None
        if following is not None and following.lower() in _VALUES:
            out.append(_VALUES[following.lower()])
            i += 1
        elif following is not None and following in extra_values:
            out.append(following)
            i += 1
        else:
            out.append("True")
    return out


@functools.cache
def optional_sections(cls: type) -> dict[str, str]:
    """Fields of ``cls`` (nested configs included) typed ``SomeConfig | None``: dotted name →
    the tyro subcommand token that turns the section on (``algo.rollout_correction`` →
    ``algo.rollout_correction:rollout_correction_config``)."""
    return dict(_optional(cls, ""))


def _optional(cls: type, prefix: str) -> list[tuple[str, str]]:
    hints = typing.get_type_hints(cls)
    found: list[tuple[str, str]] = []
    for f in dataclasses.fields(cls):
        members = _members(hints[f.name])
        nested = [m for m in members if dataclasses.is_dataclass(m) and isinstance(m, type)]
        if nested and type(None) in members:
            snake = re.sub(r"(?<!^)(?=[A-Z])", "_", nested[0].__name__).lower()
            found.append((prefix + f.name, f"{prefix}{f.name}:{snake}"))
        elif nested:
            found += _optional(nested[0], f"{prefix}{f.name}.")
    return found


def plain_sections(args: Sequence[str], *, cls: type) -> list[str]:
    """``args`` with the flags of each optional section of ``cls`` (`optional_sections`) moved
    to the end behind that section's subcommand token, so they may stand anywhere on the line
    as plain dotted flags; a line that already names the token is left as it is."""
    out = list(args)
    for name, token in optional_sections(cls).items():
        if token in out or not any(a.startswith(f"--{name}.") for a in out):
            continue
        kept: list[str] = []
        moved: list[str] = []
        target = kept
        for arg in out:
            if arg.startswith("--"):
                target = moved if arg.startswith(f"--{name}.") else kept
            target.append(arg)
        out = [*kept, token, *moved]
    return out
