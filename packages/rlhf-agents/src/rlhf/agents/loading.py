"""Load a user's Python file (reward function, environment) by path, with clear errors."""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import sys
from types import ModuleType
from typing import Any

_LOADED: dict[str, tuple[tuple[int, int], ModuleType]] = {}
"""Modules imported by `load_module`, with the (mtime, size) of the file they came from."""


def load_module(path: str | pathlib.Path, *, purpose: str) -> ModuleType:
    """Import the Python file at ``path`` as a private module; a later call for the same,
    unchanged file returns the same module (its top-level code runs once per process).

    Args:
        path: A ``.py`` file.
        purpose: What the file is for, used in error messages (e.g. "reward function").
    """
    file = pathlib.Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"{purpose} file {str(path)!r} does not exist (resolved to {file})")
    if file.suffix != ".py":
        raise ValueError(f"{purpose} file {str(file)!r} must be a .py file")
    stat = file.stat()
    version = (stat.st_mtime_ns, stat.st_size)
    name = "rlhf_user_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    loaded = _LOADED.get(name)
    if loaded is not None and loaded[0] == version:  # imported once per process and version
        return loaded[1]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {purpose} file {str(file)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("openrlhf"):
            hint = (
                f"; it imports OpenRLHF's {exc.name}: import AgentInstanceBase, "
                "MultiTurnAgentExecutor and AgentExecutorBase from rlhf.agents.openrlhf instead "
                "(the one line an OpenRLHF file changes)"
            )
        raise ImportError(f"importing {purpose} file {str(file)!r} failed: {exc!r}{hint}") from exc
    _LOADED[name] = (version, module)
    return module


def load_symbol(path: str | pathlib.Path, symbol: str, *, purpose: str) -> Any:
    """``symbol`` from the Python file at ``path``; a clear error when it is missing. Whatever
    the file defines there (``Any``, as `getattr` gives): the caller checks what it needs."""
    module = load_module(path, purpose=purpose)
    try:
        return getattr(module, symbol)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise AttributeError(
            f"{purpose} file {str(path)!r} defines no {symbol!r}; it defines: {public}"
        ) from None


def user_traceback(exc: BaseException, *, last: int = 5) -> str:
    """The lines of ``exc``'s traceback that lie in files `load_module` imported (the user's
    reward, environment and agent files), innermost last, as Python prints them; empty when
    none does. What a person needs to find their bug, without the framework's frames."""
    import traceback

    files = {str(module.__file__) for _, module in _LOADED.values() if module.__file__}
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in files]
    return "".join(traceback.format_list(frames[-last:])).rstrip()
