"""Stopping on a signal: ``SIGTERM`` and ``SIGHUP`` (a scheduler's ``scancel``, a closed
terminal) end a command the way Ctrl-C does, so its clean-up runs: the roles' actors are
killed, the log is closed and Ray's processes that this command started are shut down, instead
of being left running after the driver is gone. A second signal while that runs stops the
process at once (the default action)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals turned into `Stopped` (SIGINT already raises ``KeyboardInterrupt``)."""


class Stopped(BaseException):
    """The command was asked to stop by a signal.

    A ``BaseException`` like ``KeyboardInterrupt``: user code's ``except Exception`` does not
    swallow it.

    Attributes:
        signum: The signal's number.
        hint: What to do next (where a resume would start), when the command knows.
    """

    def __init__(self, signum: int, hint: str = "") -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.hint = hint

    @property
    def exit_code(self) -> int:
        """``128 + signum``, as a shell reports a process its signal ended."""
        return 128 + self.signum


def as_stopped(exc: BaseException, *, hint: str = "") -> Stopped:
    """``exc`` (a `Stopped` or a ``KeyboardInterrupt``) as a `Stopped` carrying ``hint``."""
    signum = exc.signum if isinstance(exc, Stopped) else int(signal.SIGINT)
    return Stopped(signum, hint or getattr(exc, "hint", ""))


_claimed: list[bool] = []  # non-empty while `stop_on_signals` is active


def _raise_stopped(signum: int, _frame: object) -> None:
    for s in STOP_SIGNALS:  # a second signal during the clean-up ends the process at once
        signal.signal(s, signal.SIG_DFL)
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[list[bool]]:
    """Within: `STOP_SIGNALS` raise `Stopped` in the main thread; on the way out, whatever
    happened, Ray is shut down if this process is connected to it (a local cluster it started
    stops with its processes; a joined cluster is only left) and the handlers are restored.

    Yields:
        A list that holds True once Ray was shut down on the way out (empty until then).
    """
    installed = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _raise_stopped) for s in STOP_SIGNALS} if installed else {}
    _claimed.append(installed)
    shut: list[bool] = []
    try:
        yield shut
    finally:
        _claimed.pop()
        try:
            shut.append(shutdown_ray())
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def claim_signals() -> None:
    """Install `Stopped`'s handlers again: ``ray.init`` (on any thread) replaces the SIGTERM
    handler with Ray's own, which dumps a stack, calls the previous handler and arms an alarm
    that aborts the process 3 s later: a clean-up longer than that ended in SIGABRT. A no-op
    outside `stop_on_signals` and off the main thread."""
    if _claimed and _claimed[-1] and threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, _raise_stopped)


def shutdown_ray() -> bool:
    """``ray.shutdown()`` when this process imported Ray and is connected to it; whether it
    was. A cluster still starting (`rlhf.cli.cluster.start_ray_early`) is waited for first,
    so that it is shut down too. Inside `rlhf.cli.warm.keep_roles_warm` the connection stays:
    the roles kept for the next run live as long as it does."""
    cluster = sys.modules.get("rlhf.cli.cluster")
    if cluster is not None:
        cluster.settle_early_start()
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    warm = sys.modules.get("rlhf.cli.warm")
    if warm is not None and warm.warm_roles() is not None:
        return False
    ray.shutdown()
    return True
