"""Tasks that nothing awaits (a P/D leg, a KV export, an import shielded from its caller), and
stopping the endless ones.

The event loop holds only weak references to tasks, so a task nobody keeps may be collected
before it finishes: `background` keeps each one referenced until it is done.
"""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

_RUNNING: set[asyncio.Future] = set()
RECANCEL_S = 0.5  # how long a cancelled task has to end before it is cancelled again


def background(aw: Awaitable[T]) -> "asyncio.Future[T]":
    """`aw` as a task (or future) kept referenced until it is done."""
    task = asyncio.ensure_future(aw)
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return task


async def cancel_and_wait(*tasks: asyncio.Future) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again each `RECANCEL_S` a task
    goes on: redis-py 8.2 at times swallows a cancel inside a blocking read (XREAD, about one in
    200), and the endless loop around the read reads on, so one cancel and a wait can hang a
    shutdown for good. A cancel of the caller meanwhile is raised once they have ended, so none
    is left running unowned. Their errors are retrieved here (nothing else awaits them)."""
    pending, interrupted = {t for t in tasks if not t.done()}, False
    while pending:
        for t in pending:
            t.cancel()
        try:
            await asyncio.wait(pending, timeout=RECANCEL_S)
        except asyncio.CancelledError:
            interrupted = True
        pending = {t for t in pending if not t.done()}
    for t in tasks:
        if not t.cancelled():
            t.exception()
    if interrupted:
        raise asyncio.CancelledError
