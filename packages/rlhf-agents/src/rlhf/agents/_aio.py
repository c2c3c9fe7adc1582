"""asyncio helpers shared by the executors."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")


async def gather_or_cancel(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Like `asyncio.gather`, but the first failure cancels the rest before it is raised.

    Plain ``gather`` leaves the other tasks running after an exception, so a failing sample
    would let its siblings keep generating (and, for agents, outlive the server they talk to).
    """
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    if not tasks:
        return []
    try:
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    # Ask every finished task for its exception: two that failed together (both samples of a
    # dead engine) would otherwise log "Task exception was never retrieved" at exit.
    errors = [t.exception() for t in tasks if t.done() and not t.cancelled()]
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise failed
    return [t.result() for t in tasks]


async def in_daemon_thread(func: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``func(*args, **kwargs)`` on a daemon thread of its own. Unlike `asyncio.to_thread`
    (whose pool threads the interpreter joins at exit), a call abandoned after its timeout that
    never returns cannot keep the process from exiting."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        outcome: Callable[[], None]
        try:
            result = func(*args, **kwargs)
            outcome = functools.partial(done.set_result, result)
        except Exception as exc:  # handed to the awaiting coroutine
            outcome = functools.partial(done.set_exception, exc)
        except BaseException as exc:  # sys.exit() in user code must not end the caller
            error = RuntimeError(f"{getattr(func, '__name__', func)!s} raised {exc!r}")
            outcome = functools.partial(done.set_exception, error)

        def settle() -> None:
            if not done.done():  # not abandoned (timed out, cancelled)
                outcome()

        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for this call
            loop.call_soon_threadsafe(settle)

    threading.Thread(target=run, name="rlhf-reward-call", daemon=True).start()
    return await done
