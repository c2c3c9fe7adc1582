"""Roles kept warm between the runs of one process.

On a CPU, starting a short run's processes is most of its time: a two-step ``rlhf train grpo``
of the demo's model spends ~9 of its ~10 s waiting for the vLLM engine (vLLM's import and
build) and the learner ranks (imports, DeepSpeed's set-up). Inside `keep_roles_warm`, a run
that ends without an error leaves its engines and learner rank groups running, and the next
run of the same process takes over those started with the same options instead of starting
new ones:

- an engine is reset to what a freshly started one serves (`rlhf.rollout.RayEngine.reset`:
  the model directory's weights loaded again and verified, its seed and counters reset);
- a rank group builds the new run's model and optimizer on its ranks
  (`rlhf.learner.LearnerGroup.start_build`, as every run does; the backends seed themselves).

What the next run does not take is stopped when it starts its roles, so at most one run's
processes stay. Only roles on Ray's own resources are kept: those in a placement group or on
named nodes stop with their run, as outside the context. Runs that share a process: a test
session, a sweep, a notebook (`rlhf.cli.main.main` called again and again).

While warm roles may be kept, a command leaves the Ray connection open (the kept actors live
as long as this driver): the context's exit stops the roles it still holds; the caller
disconnects from Ray.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf.learner import LearnerGroup
    from rlhf.rollout import RayEngine


class WarmRoles:
    """Engines and learner rank groups parked between runs, by the options they started with
    (a key: the repr of everything that shapes the process)."""

    def __init__(self) -> None:
        self._engines: list[tuple[str, list[RayEngine]]] = []
        self._groups: list[tuple[str, LearnerGroup]] = []
        self.taken = {"engines": 0, "groups": 0}
        """How many engine sets and rank groups runs took over (for tests and logs)."""

    def take_engines(self, key: str) -> list[RayEngine] | None:
        """Parked engines started with ``key``, reset for a new run; None when there are
        none (or they no longer answer: they are stopped)."""
        for i, (parked, engines) in enumerate(self._engines):
            if parked != key:
                continue
            del self._engines[i]
            try:
                fresh = [e.reset() for e in engines]
            except Exception:  # a dead or broken engine: the run starts new ones
                _stop_engines(engines)
                return None
            self.taken["engines"] += 1
            return fresh
        return None

    def take_group(self, key: str) -> LearnerGroup | None:
        """A parked rank group started with ``key`` whose ranks all answer, or None."""
        for i, (parked, group) in enumerate(self._groups):
            if parked != key:
                continue
            del self._groups[i]
            try:
                group.num_threads()  # every rank answers
            except Exception:  # a dead rank: the run starts a new group
                _stop_group(group)
                continue
            self.taken["groups"] += 1
            return group
        return None

    def park(
        self, *, engines: tuple[str, list[RayEngine]] | None, groups: list[tuple[str, Any]]
    ) -> None:
        """Keep a finished run's roles for the next run."""
        if engines is not None:
            self._engines.append(engines)
        self._groups.extend(groups)

    def stop_unclaimed(self) -> None:
        """Stop every parked role (what a run that has started its roles did not take)."""
        engines, groups = self._engines, self._groups
        self._engines, self._groups = [], []
        for _, parked in engines:
            _stop_engines(parked)
        for _, group in groups:
            _stop_group(group)

    @property
    def parked(self) -> int:
        """Parked engine sets and rank groups."""
        return len(self._engines) + len(self._groups)


def _stop_engines(engines: list[RayEngine]) -> None:
    for engine in engines:
        with contextlib.suppress(Exception):  # already dead: nothing to stop
            engine.shutdown()


def _stop_group(group: LearnerGroup) -> None:
    with contextlib.suppress(Exception):
        group.shutdown()


_active: list[WarmRoles] = []


@contextlib.contextmanager
def keep_roles_warm() -> Iterator[WarmRoles]:
    """Within, runs hand their roles to the next run (see the module's docstring); on the
    way out the roles still parked are stopped."""
    warm = WarmRoles()
    _active.append(warm)
    try:
        yield warm
    finally:
        _active.remove(warm)
        warm.stop_unclaimed()


def release_group(group: LearnerGroup, key: str | None, *, keep: bool) -> None:
    """A single-role run (``rlhf train sft|rm|dpo``) is over: park its ranks for a later run
    (``keep``: it ended without an error; a ``key``: they are not placed; inside
    `keep_roles_warm`), else stop them."""
    warm = warm_roles()
    if keep and key is not None and warm is not None:
        warm.park(engines=None, groups=[(key, group)])
    else:
        group.shutdown()


def warm_roles() -> WarmRoles | None:
    """The innermost `keep_roles_warm` pool, or None outside one."""
    return _active[-1] if _active else None
