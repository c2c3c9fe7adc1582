"""asyncio helpers shared by the executors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


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
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
    if failed is not None:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise failed.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]
