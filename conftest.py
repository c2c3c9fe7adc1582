"""Shared by every member's tests: a test that outlives its timeout (``timeout`` in the root
pyproject, read by pytest-timeout) does not hold the run.

pytest-timeout's own ways do not fit tests that wait on Ray: SIGALRM's handler never runs
while the main thread blocks in ``ray.get``/``ray.wait`` (only SIGINT interrupts those), and
its thread method ends the process without a word on which test it was. So this watchdog
takes over its timer (`pytest_timeout_set_timer`). At the timeout it writes the test's name,
every thread's stack (faulthandler) and the stacks of the Ray actors it may be waiting on
(each rank and engine actor dumps its stacks into its Ray log on SIGUSR1:
`rlhf.learner.RankWorker`, `rlhf.rollout.EngineActor`), then

1. fails the test in its main thread (SIGALRM's handler raises), and the run goes on;
2. if the main thread has not come back from C after `ESCALATE_S` (a ``ray.get``), sends
   SIGINT: the ``KeyboardInterrupt`` stops the run, which still reports what ran;
3. if even that is not answered after `INTERRUPT_S` more, ends the process (exit 1).
"""

from __future__ import annotations

import _thread
import faulthandler
import glob
import os
import signal
import sys
import threading
import time

import pytest

STACK_SIGNAL = signal.SIGUSR1
ACTORS = ("ray::RankWorker", "ray::EngineActor")
ESCALATE_S = 10.0
INTERRUPT_S = 30.0
"""How long a SIGINT may take to stop the run before the process exits (Ray answers it in
ray.get within a second)."""


def _actor_pids() -> list[int]:
    """Live processes whose title names one of our Ray actors (Ray sets ``ray::Class...``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(ACTORS):
            pids.append(int(entry))
    return pids


def _logs_of(pid: int) -> list[str]:
    """Ray's stderr logs of worker ``pid`` (``worker-<id>-<job>-<pid>.err``, any session)."""
    return glob.glob(f"/tmp/ray/session_*/logs/worker-*-{pid}.err")


def actor_stacks(*, wait_s: float = 1.0, tail: int = 6000) -> str:
    """Ask every live rank and engine actor for its stacks and return what they wrote."""
    pids = _actor_pids()
    sizes = {}
    for pid in pids:
        for log in _logs_of(pid):
            sizes[log] = os.path.getsize(log)
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            continue
    time.sleep(wait_s)
    parts = []
    for pid in pids:
        for log in _logs_of(pid):
            with open(log, errors="replace") as f:
                f.seek(sizes.get(log, 0))
                written = f.read()[-tail:]
            if written.strip():
                parts.append(f"--- pid {pid} ({log}) ---\n{written}")
    return "\n".join(parts) or f"(no stacks from {len(pids)} Ray actor process(es))"


class Watchdog:
    """One test's timer (see the module's docstring)."""

    def __init__(self, item: pytest.Item, timeout: float) -> None:
        self.item = item
        self.timeout = timeout
        self.done = threading.Event()
        self.fired = False
        self.previous = signal.signal(signal.SIGALRM, self._fail)
        self.thread = threading.Thread(target=self._watch, name="test-watchdog", daemon=True)
        self.thread.start()

    def _fail(self, signum: int, frame: object) -> None:
        if self.fired and not self.done.is_set():
            pytest.fail(f"Timeout (>{self.timeout:.1f}s) from pytest-timeout.", pytrace=False)

    def _say(self, *lines: str, stacks: bool = False) -> None:
        """Write to the real stderr (pytest captures fd 2 while a test runs)."""
        capture = self.item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=False)
        out = sys.__stderr__
        try:
            for line in lines:
                print(f"+++ {self.item.nodeid}: {line}", file=out, flush=True)
            if stacks:
                print("+++ the stacks of this process's threads:", file=out, flush=True)
                faulthandler.dump_traceback(file=out, all_threads=True)
                print("+++ the stacks of the Ray actors (SIGUSR1):", file=out)
                print(actor_stacks(), file=out, flush=True)
        finally:
            if capture is not None:
                capture.resume_global_capture()

    def _watch(self) -> None:
        if self.done.wait(self.timeout):
            return
        self.fired = True
        self._say(f"over its {self.timeout:.0f} s timeout", stacks=True)
        _thread.interrupt_main(signal.SIGALRM)  # runs `_fail` once Python code runs again
        if self.done.wait(ESCALATE_S):
            return
        self._say("the main thread is blocked in C (a ray.get?): stopping the test run (SIGINT)")
        os.kill(os.getpid(), signal.SIGINT)
        if self.done.wait(INTERRUPT_S):
            return
        self._say("no answer to SIGINT either: exiting")
        os._exit(1)

    def cancel(self) -> None:
        self.done.set()
        signal.signal(signal.SIGALRM, self.previous)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> bool | None:
    if settings.timeout <= 0 or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own handling
    item.stash[_WATCHDOG] = Watchdog(item, settings.timeout)
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    watchdog = item.stash.get(_WATCHDOG, None)
    if watchdog is None:
        return None
    watchdog.cancel()
    del item.stash[_WATCHDOG]
    return True


_WATCHDOG = pytest.StashKey[Watchdog]()


def pytest_configure(config: pytest.Config) -> None:
    """The watchdog's second step is a SIGINT; a test run started in the background by a
    shell without job control (``command &``, ``nohup``) inherits SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler. Give it back, so that step works wherever
    the run was started."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
