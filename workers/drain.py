"""Graceful shutdown for a worker or the gateway: drain first, then let uvicorn stop.

The first SIGTERM (or SIGINT) marks the server draining: /health (and a worker's /state) say
so, so the gateway (or a load balancer) stops sending there; new requests get 503 +
Retry-After, and the ones in flight (a worker's KV exports too) run to the end. Once nothing
is left, or `drain_timeout_s` has passed, uvicorn's own shutdown runs. A second signal exits
at once. Torch-free: the gateway uses it too.
"""

import logging
import signal
import time
from types import FrameType
from typing import Protocol

import uvicorn

log = logging.getLogger("kvgate.drain")


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

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
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
