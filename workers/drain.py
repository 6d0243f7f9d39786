"""Graceful shutdown for a worker or the gateway: drain first, then let uvicorn stop.

The first SIGTERM (or SIGINT) marks the server draining: /health (and a worker's /state) say
so, so the gateway (or a load balancer) stops sending there; new requests get 503 +
Retry-After, and the ones in flight (a worker's KV exports too) run to the end. Once nothing
is left, or `drain_timeout_s` has passed, uvicorn's own shutdown runs. A second signal exits
at once. Torch-free: the gateway uses it too.

The server's housekeeping tick (the Date header, the exit check) comes once a second, and
every 0.1 s only while draining; a signal wakes it at once. uvicorn's own tick, ten times a
second, was a third of an idle gateway's CPU (each wakeup is a context switch).
"""

import asyncio
import contextlib
import logging
import signal
import time
from types import FrameType
from typing import Protocol

import uvicorn

log = logging.getLogger("kvgate.drain")
TICK_S = 1.0
DRAIN_TICK_S = 0.1  # how soon a drained server exits


class Drainable(Protocol):
    """What drains: a `draining` flag it honours, and what it still holds."""

    draining: bool

    @property
    def in_flight(self) -> int: ...

    @property
    def idle(self) -> bool: ...


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, worker: Drainable, drain_timeout_s: float = 30.0):
        super().__init__(config)
        self.worker = worker
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self.wake: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        """uvicorn's loop of ticks, at `TICK_S` (`DRAIN_TICK_S` while draining); `on_tick`
        sees a counter that passes a multiple of 10 once a second, as at uvicorn's 0.1 s."""
        self.wake, self.loop = asyncio.Event(), asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):
            draining = self.drain_deadline is not None
            counter = (counter + (1 if draining else 10)) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), DRAIN_TICK_S if draining else TICK_S)
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
