"""A command line with OpenRLHF's flags, rewritten in our spelling (`translate`), and what no
table knows (`unknown_flag_problems`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rlhf.cli.config import ConfigError
from rlhf.cli.openrlhf.docs import meaning
from rlhf.cli.openrlhf.entries import (
    NOTE,
    SWITCH_VALUES,
    Alias,
    Arity,
    Gathered,
    Notice,
    Refused,
    Same,
)
from rlhf.cli.openrlhf.groups import FINISHERS
from rlhf.cli.openrlhf.tables import EARLIER, TABLES


@dataclass(frozen=True)
class Translated:
    """A command line in our spelling, and the notices its OpenRLHF flags earned."""

    args: list[str]
    notices: list[str] = field(default_factory=list)


def _take(args: Sequence[str], i: int, arity: Arity, inline: str | None) -> tuple[list[str], int]:
    """The values of the flag at ``args[i]`` and the index after them."""
    if inline is not None:
        return [inline], i + 1
    rest = list(args[i + 1 :])
    if arity == "switch":
        if rest and rest[0].lower() in SWITCH_VALUES:
            return [SWITCH_VALUES[rest[0].lower()]], i + 2
        return ["True"], i + 1
    if arity == "one":
        return rest[:1], i + 1 + len(rest[:1])
    if arity == "two":
        return rest[:2], i + 1 + len(rest[:2])
    values = []
    for token in rest:
        if token.startswith("--"):
            break
        values.append(token)
    return values, i + 1 + len(values)


def translate(args: Sequence[str], *, entry_point: str) -> Translated:
    """``args`` with the OpenRLHF flags of ``entry_point`` rewritten in our spelling.

    Raises `ConfigError` for a refused flag or value (naming the flag and what to use)."""
    table = TABLES[entry_point]
    out: list[str] = []
    tail: list[str] = []
    notices: list[str] = []
    gathered: dict[str, dict[str, list[str]]] = {}
    i = 0
    while i < len(args):
        token = args[i]
        name, eq, inline_value = (
            token[2:].partition("=") if token.startswith("--") else ("", "", "")
        )
        row = table.get(name) or EARLIER.get(entry_point, {}).get(name)
        if row is None or isinstance(row.entry, Same):
            out.append(token)
            i += 1
            continue
        values, i = _take(args, i, row.arity, inline_value if eq else None)
        wanted = {"one": 1, "two": 2}.get(row.arity)
        if (wanted and len(values) != wanted) or not values:
            raise ConfigError(f"--{name} takes {wanted or 'one or more'} value(s)")
        entry = row.entry
        if isinstance(entry, Refused):
            raise ConfigError(f"--{name}: {entry.message}")
        if isinstance(entry, Notice):
            notices.append(f"--{name} is accepted and has no effect here: {entry.message}")
        elif isinstance(entry, Gathered):
            gathered.setdefault(entry.group, {})[name] = values
        else:
            out += _aliased(name, entry, values)
    for group, given in gathered.items():
        for token in FINISHERS[group](given):
            if token.startswith(NOTE):
                notices.append(token[len(NOTE) :])
            else:
                (tail if group == "correction" else out).append(token)
    return Translated(out + tail, notices)


def unknown_flag_problems(
    args: Sequence[str], *, entry_point: str, ours: frozenset[str]
) -> list[str]:
    """A message for each ``--flag`` of ``args`` that is neither ours (``ours``: the command's
    dotted fields) nor OpenRLHF's, with the nearest spellings of both."""
    import difflib

    theirs = set(TABLES[entry_point]) | set(EARLIER.get(entry_point, {}))
    problems = []
    for token in args:
        if not token.startswith("--") or token in ("--config", "--help", "--help-all", "--debug"):
            continue
        name = token[2:].partition("=")[0]
        if name in ours or name in theirs:
            continue
        near_ours = difflib.get_close_matches(name, sorted(ours), n=2, cutoff=0.75)
        near_theirs = difflib.get_close_matches(name, sorted(theirs), n=2, cutoff=0.75)
        rows = {**EARLIER.get(entry_point, {}), **TABLES[entry_point]}
        hints = [f"--{n}" for n in near_ours] + [
            f"--{n} (OpenRLHF's: {meaning(rows[n])[0]})".replace("`", "") for n in near_theirs
        ]
        hint = f"; did you mean {' or '.join(hints)}?" if hints else ""
        problems.append(f"unknown flag --{name}{hint}")
    return problems


def _aliased(name: str, entry: Alias, values: list[str]) -> list[str]:
    if isinstance(entry.values, Mapping):
        if values[0] not in entry.values:
            accepted = ", ".join(entry.values)
            raise ConfigError(f"--{name} {values[0]}: accepted here: {accepted}")
        values = [entry.values[values[0]]]
    elif entry.values is not None:
        try:
            values = entry.values(values)
        except ConfigError as exc:  # name the flag unless the message does
            text = str(exc)
            if not text.startswith("--"):
                text = f"--{name} {' '.join(values)}: {text}"
            raise ConfigError(text) from None
    tokens: list[str] = []
    for target in entry.fields:
        tokens += [f"--{target}", *values]
    return tokens
