"""Graceful shutdown for a worker or the gateway: drain first, then let uvicorn stop.

The first SIGTERM (or SIGINT) marks the server draining: /health (and a worker's /state) say
so, so the gateway (or a load balancer) stops sending there; new requests get 503 +
Retry-After, and the ones in flight (a worker's KV exports too) run to the end. Once nothing
is left, or `drain_timeout_s` has passed, uvicorn's own shutdown runs. A second signal exits
at once. Torch-free: the gateway uses it too.

The server's housekeeping tick (the exit check) comes only when a signal wakes it, and every
0.1 s while draining; the Date header is made when a response asks for it (`LazyDateState`,
once a second at most), not refreshed by a timer. uvicorn's own tick, ten times a second,
was a third of an idle gateway's CPU; one a second was still half of it (each wakeup is a
context switch, ~0.3 ms on a small VM).
"""

import asyncio
import contextlib
import logging
import signal
import time
from email.utils import formatdate
from types import FrameType
from typing import Protocol

import uvicorn

log = logging.getLogger("kvgate.drain")
DRAIN_TICK_S = 0.1  # how soon a drained server exits


class Drainable(Protocol):
    """What drains: a `draining` flag it honours, and what it still holds."""

    draining: bool

    @property
    def in_flight(self) -> int: ...

    @property
    def idle(self) -> bool: ...


class LazyDateState(uvicorn.server.ServerState):
    """uvicorn's server state whose default headers (the protocols read them once a response)
    carry a Date made on that read, remade when the second has changed: the same header
    uvicorn's tick keeps, without a timer waking the server every second to keep it."""

    def __init__(self, config: uvicorn.Config):
        self.config = config
        self._second = -1
        self._headers: list[tuple[bytes, bytes]] = []
        super().__init__()

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        now = int(time.time())
        if now != self._second:
            date = [(b"date", formatdate(now, usegmt=True).encode())] if self.config.date_header else []
            self._second, self._headers = now, date + self.config.encoded_headers
        return self._headers

    @default_headers.setter
    def default_headers(self, value: list[tuple[bytes, bytes]]) -> None:
        """uvicorn's `__init__` and tick assign them: the headers are made on read instead."""


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, worker: Drainable, drain_timeout_s: float = 30.0):
        super().__init__(config)
        self.server_state = LazyDateState(config)
        self.worker = worker
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self.wake: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        """uvicorn's loop of ticks: one each time a signal wakes it, and each `DRAIN_TICK_S`
        while draining, until `on_tick` says to exit. Its counter is always 0: uvicorn reads it
        only to space Date refreshes, and `LazyDateState` makes that header on read."""
        self.wake, self.loop = asyncio.Event(), asyncio.get_running_loop()
        while not await self.on_tick(0):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), DRAIN_TICK_S if self.drain_deadline is not None else None)
            self.wake.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.loop is not None and self.wake is not None:
            self.loop.call_soon_threadsafe(self.wake.set)  # a signal handler: not in a callback
        if self.worker.draining:
            self.should_exit = self.force_exit = True
            return
        log.warning(
            "%s: draining %d requests (at most %.0f s)",
            signal.Signals(sig).name,
            self.worker.in_flight,
            self.drain_timeout_s,
        )
        self.worker.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if (
            self.drain_deadline is not None
            and not self.should_exit
            and (self.worker.idle or time.monotonic() >= self.drain_deadline)
        ):
            self.should_exit = True
        return await super().on_tick(counter)
