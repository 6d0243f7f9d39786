"""A timeout on silence for a loop of reads: `TimeoutError` once a read has waited `idle_s`.

`asyncio.timeout(...).reschedule` around every read of a stream re-armed a timer handle twice
per token event, a sixth of the gateway's CPU per relayed token; here a read only flips a flag
and notes the time, and one timer, re-armed when it comes due, looks at those.
"""

import asyncio
from types import TracebackType


class IdleWatch:
    """`with IdleWatch(idle_s) as w:` around a loop whose reads are bracketed by `w.waiting()`
    and `w.got()`: a read that has waited `idle_s` seconds is cancelled and the block raises
    TimeoutError; time spent outside reads (a slow client's writes) never counts."""

    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self.loop = asyncio.get_running_loop()
        self.since = 0.0
        self.reading = False
        self.expired = False
        self._task: asyncio.Task | None = None
        self._cancelling = 0
        self._handle: asyncio.TimerHandle | None = None

    def __enter__(self) -> "IdleWatch":
        self._task = asyncio.current_task()
        assert self._task is not None, "an IdleWatch runs in a task"
        self._cancelling = self._task.cancelling()
        self._handle = self.loop.call_at(self.loop.time() + self.idle_s, self._due)
        return self

    def waiting(self) -> None:
        """A read starts waiting now."""
        self.since = self.loop.time()
        self.reading = True

    def got(self) -> None:
        """The read has its data."""
        self.reading = False

    def _due(self) -> None:
        now = self.loop.time()
        if self.reading and now - self.since >= self.idle_s:
            self.expired = True
            assert self._task is not None
            self._task.cancel()
            return
        start = self.since if self.reading else now
        self._handle = self.loop.call_at(start + self.idle_s, self._due)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self.expired and kind is asyncio.CancelledError:
            assert self._task is not None
            if self._task.uncancel() <= self._cancelling:
                raise TimeoutError from exc
