"""Name → implementation registries, one per family of functions.

Each family has one fixed call signature (documented where the registry is defined). Variants are
registry entries, never branches of an if-chain in a trainer; an unknown name is a `ValueError`
that lists the registered names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of implementations of one family.

    Args:
        family: Human-readable family name used in error messages, e.g. ``"advantage estimator"``.
    """

    def __init__(self, family: str) -> None:
        self.family = family
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        """Decorator that registers an implementation under ``name`` (and ``aliases``)."""

        def decorator(obj: T) -> T:
            for key in (name, *aliases):
                if key in self._entries or key in self._aliases:
                    raise ValueError(f"{self.family} {key!r} is already registered")
            self._entries[name] = obj
            for alias in aliases:
                self._aliases[alias] = name
            return obj

        return decorator

    def canonical(self, name: str) -> str:
        """The registered name behind ``name`` (resolving aliases); `ValueError` if unknown."""
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name]
        raise ValueError(
            f"unknown {self.family} {name!r}; choose one of: {', '.join(self.names())}"
        )

    def get(self, name: str) -> T:
        """The implementation registered under ``name`` or one of its aliases."""
        return self._entries[self.canonical(name)]

    def names(self) -> list[str]:
        """Registered names and aliases, sorted."""
        return sorted([*self._entries, *self._aliases])

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)
