"""``--config FILE``: values from a YAML or JSON file, nested like the flags
(``rollout: {batch_size: 8}`` is ``--rollout.batch_size 8``), checked against the config
classes before anything starts.

Every problem is reported at once, each with ``file:line`` (YAML) and the flag it stands for:
unknown keys, a scalar where a section belongs (``algo: 5`` would otherwise replace the
preset's whole ``algo`` section), values of the wrong type (``num_steps: 2.5``,
``enforce_eager: "yes"``), values a config class refuses, and syntax errors. A scalar given to a
text field is read as the flag would read it (``verify_sync: true`` is ``--vllm.verify_sync
True``); an integer given to a float field becomes a float; a list given to a tuple field
becomes a tuple.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from rlhf.cli.config import ConfigError, canonical_flag, raise_problems

T = TypeVar("T")
_MISMATCH = object()


def load(default: T, path: str) -> T:
    """``default`` with the file's values applied.

    Raises:
        ConfigError: listing every problem, each naming ``file:line`` and the flag.
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path!r}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"--config {path!r}: not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    values, lines = (
        _parse_yaml(text, path) if p.suffix in (".yaml", ".yml") else _parse_json(text, path)
    )
    if values is None:
        return default
    if not isinstance(values, dict):
        raise ConfigError(
            f"{path}: expected sections and values (like the flags: 'rollout: {{batch_size: 8}}'), "
            f"got a {type(values).__name__}"
        )
    problems: list[str] = []

    def where(dotted: str) -> str:
        return f"{path}:{lines[dotted]}" if dotted in lines else path

    merged = _merge(default, values, prefix="", where=where, problems=problems)
    raise_problems(problems, where=path)
    return merged


def keys(path: str) -> set[str]:
    """The dotted names (``rollout.batch_size``) the file at ``path`` sets, sections included;
    read after `load` accepted the file."""
    text = pathlib.Path(path).read_text(encoding="utf-8")
    if pathlib.Path(path).suffix in (".yaml", ".yml"):
        return set(_parse_yaml(text, path)[1])
    out: set[str] = set()

    def walk(values: Any, prefix: str) -> None:
        if isinstance(values, dict):
            for key, value in values.items():
                out.add(f"{prefix}{key}")
                walk(value, f"{prefix}{key}.")

    walk(_parse_json(text, path)[0], "")
    return out


def _parse_yaml(text: str, path: str) -> tuple[Any, dict[str, int]]:
    """The document and the line of every key (dotted like the flags)."""
    import yaml

    try:
        values = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{at}: not valid YAML: {problem}") from None
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key, value in node.value:
            dotted = f"{prefix}{key.value}"
            lines[dotted] = key.start_mark.line + 1
            walk(value, f"{dotted}.")

    walk(root, "")
    return values, lines


def _parse_json(text: str, path: str) -> tuple[Any, dict[str, int]]:
    try:
        return json.loads(text), {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None


def _merge(
    obj: Any,
    values: dict[str, Any],
    *,
    prefix: str,
    where: Callable[[str], str],
    problems: list[str],
) -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    try:
        hints = typing.get_type_hints(type(obj))
    except (NameError, TypeError):  # an annotation this module cannot resolve: no type check
        hints = {}
    changes = {}
    for key, value in values.items():
        dotted = canonical_flag(f"{prefix}{key}")
        key = dotted.rsplit(".", 1)[-1]  # an alias names a field of the same section
        if key not in fields:
            problems.append(
                f"{where(dotted)}: unknown key {dotted!r} (no flag --{dotted}); known here: "
                f"{', '.join(sorted(fields))}"
            )
            continue
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                problems.append(
                    f"{where(dotted)}: {dotted} is a section (the --{dotted}.* flags): expected "
                    f"its keys and values, got {value!r}"
                )
                continue
            changes[key] = _merge(
                current, value, prefix=f"{dotted}.", where=where, problems=problems
            )
            continue
        hint = hints.get(key, Any)
        converted = _convert(value, hint)
        if converted is _MISMATCH:
            problems.append(
                f"{where(dotted)}: {dotted} (--{dotted}) expects {_describe(hint)}, got {value!r}"
            )
            continue
        changes[key] = converted
    try:
        return dataclasses.replace(obj, **changes)
    except (ValueError, TypeError) as e:  # a config class's own checks (__post_init__)
        section = prefix.rstrip(".") or "the top level"
        problems.append(f"{where(prefix.rstrip('.'))}: {section}: {e}")
        return obj


def _convert(value: Any, hint: Any) -> Any:
    """``value`` as a ``hint`` field holds it, or `_MISMATCH`."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in sorted(args, key=lambda a: a is str):  # text last: it takes any scalar
            converted = _convert(value, arg)
            if converted is not _MISMATCH:
                return converted
        return _MISMATCH
    if hint is type(None):
        return None if value is None else _MISMATCH
    if origin is typing.Literal:
        return value if value in args else _MISMATCH
    if origin is tuple:
        if not isinstance(value, list | tuple):
            return _MISMATCH
        item = args[0] if args else Any
        items = [_convert(v, item) for v in value]
        return _MISMATCH if any(i is _MISMATCH for i in items) else tuple(items)
    if hint is bool:
        return value if isinstance(value, bool) else _MISMATCH
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _MISMATCH
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return float(value) if ok else _MISMATCH
    if hint is str:  # as the flag would read it
        return str(value) if isinstance(value, str | int | float | bool) else _MISMATCH
    if isinstance(hint, type):
        return value if isinstance(value, hint) else _MISMATCH
    return value


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "null"
    if origin is tuple:
        return f"a list of {_describe(args[0]) if args else 'values'}"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "text"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))
