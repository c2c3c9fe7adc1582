"""The engine's error type, shared by the engine and its weight checks."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine failed to start or to serve a request."""
