"""Tasks that nothing awaits (a P/D leg, a KV export, an import shielded from its caller).

The event loop holds only weak references to tasks, so a task nobody keeps may be collected
before it finishes: `background` keeps each one referenced until it is done.
"""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

_RUNNING: set[asyncio.Future] = set()


def background(aw: Awaitable[T]) -> "asyncio.Future[T]":
    """`aw` as a task (or future) kept referenced until it is done."""
    task = asyncio.ensure_future(aw)
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return task
