"""Graceful shutdown for a worker: drain first, then let uvicorn stop.

The first SIGTERM (or SIGINT) marks the worker draining: /health and /state say so (the
gateway stops routing to it), new requests get 503 + Retry-After, and the ones in flight, and
their KV exports, run to the end. Once nothing is left, or `drain_timeout_s` has passed,
uvicorn's own shutdown runs. A second signal exits at once.
"""
import logging
import signal
import time
from types import FrameType

import uvicorn

from workers.server import WorkerServer

log = logging.getLogger("kvgate.worker")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, worker: WorkerServer, drain_timeout_s: float = 30.0):
        super().__init__(config)
        self.worker = worker
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.worker.draining:
            self.should_exit = self.force_exit = True
            return
        log.warning("%s: draining %d requests (at most %.0f s)", signal.Signals(sig).name,
                    self.worker.in_flight, self.drain_timeout_s)
        self.worker.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit and (
                self.worker.idle or time.monotonic() >= self.drain_deadline):
            self.should_exit = True
        return await super().on_tick(counter)
