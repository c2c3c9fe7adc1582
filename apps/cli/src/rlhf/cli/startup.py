"""Where a run's time goes before its first step.

`Stopwatch` records named start-up phases one after another (``lap``) and, for roles that
start side by side, when each became ready (``ready``). The RL command writes the record to
``run_dir/startup.json`` after step 1 and prints it as one ``[startup]`` line, e.g.::

    [startup] 14.2 s to step 1: imports 3.1, setup 0.4, ray 3.9, roles 5.2
              (engines 5.2, actor 4.1), eval 0.9, step 1 0.7

``imports`` runs from the interpreter's start (the process's creation time) to the command's
first line, so the record covers everything a user waits for.
"""

from __future__ import annotations

import time
from typing import Any


def _process_age_s() -> float:
    """Seconds since this process was created (0.0 where that is unknown)."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # psutil missing or the platform refuses: the phase is then unmeasured
        return 0.0


_imports_counted: list[bool] = []  # non-empty once a Stopwatch counted the process's imports


class Stopwatch:
    """Consecutive start-up phases, in seconds.

    Args:
        since_process_start: Count the time before construction as the phase ``imports``:
            for the process's first command only (a later command of the same process,
            `rlhf.cli.main.main` called again, imports nothing: the phase is 0).
    """

    def __init__(self, *, since_process_start: bool = True) -> None:
        self._last = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.roles: dict[str, float] = {}
        if since_process_start:
            self.phases["imports"] = 0.0 if _imports_counted else _process_age_s()
            _imports_counted.append(True)

    def lap(self, phase: str) -> float:
        """End ``phase`` now (it began where the previous one ended); returns its seconds."""
        now = time.perf_counter()
        seconds = now - self._last
        self._last = now
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        return seconds

    def ready(self, role: str, seconds: float) -> None:
        """``role`` became ready ``seconds`` after the roles' start."""
        self.roles[role] = seconds

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    def report(self) -> dict[str, Any]:
        return {
            "to_step_1_s": round(self.total_s, 3),
            "phases_s": {k: round(v, 3) for k, v in self.phases.items()},
            "roles_ready_s": {k: round(v, 3) for k, v in self.roles.items()},
        }

    def line(self) -> str:
        phases = ", ".join(
            f"{name} {seconds:.1f}"
            + (
                " (" + ", ".join(f"{r} {s:.1f}" for r, s in self.roles.items()) + ")"
                if name == "roles" and self.roles
                else ""
            )
            for name, seconds in self.phases.items()
        )
        return f"{self.total_s:.1f} s to step 1: {phases}"
