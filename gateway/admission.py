"""Admission control: how much the gateway takes on, and the answer to what it will not.

Beyond capacity a queue only adds latency to every request behind it, so the gateway sheds
load at the door instead, cheaply and explicitly: an OpenAI-shaped 503 (or 429) with a
`Retry-After`, never a reset or a timeout. Two bounds:

- the fleet bound `max_pending`: requests this gateway holds at once (being tokenized,
  routed, waiting on a worker, streaming); it also bounds the gateway's memory and upstream
  connections.
- the per-worker bound `max_queue_per_worker`: requests waiting at a worker beyond the batch
  it runs at once. A full worker is no candidate; when every candidate is full the request
  is refused (`overloaded`), so admitted requests wait behind at most that many others.

While the gateway drains (SIGTERM) every new request is refused (`draining`).
"""

from dataclasses import dataclass
from typing import Protocol, TypeVar

OVERLOADED, DRAINING = "overloaded", "draining"


@dataclass(frozen=True)
class AdmissionConfig:
    max_pending: int = 1024
    max_queue_per_worker: int = 32
    retry_after_s: int = 1


@dataclass(frozen=True)
class Refusal:
    """Why a request is not taken: an HTTP status, an OpenAI error code and a message."""

    status: int
    code: str
    message: str
    retry_after_s: int


class Queued(Protocol):
    def queued(self) -> int:
        """Requests waiting at the worker beyond its running batch (`gateway.worker.Worker`)."""
        ...


W = TypeVar("W", bound=Queued)


class Admission:
    """The gateway's door: counts what it holds and says no beyond the bounds."""

    def __init__(self, config: AdmissionConfig | None = None):
        self.config = config or AdmissionConfig()
        self.pending = 0
        self.draining = False

    def refuse(self) -> Refusal | None:
        """Why a new request cannot be taken now, or None (then call `enter`)."""
        c = self.config
        if self.draining:
            return Refusal(503, DRAINING, "this gateway is shutting down; retry on another replica", c.retry_after_s)
        if self.pending >= c.max_pending:
            return Refusal(
                503,
                OVERLOADED,
                f"the gateway holds its limit of {c.max_pending} requests; retry later",
                c.retry_after_s,
            )
        return None

    @property
    def in_flight(self) -> int:
        return self.pending

    @property
    def idle(self) -> bool:
        """Nothing held: a draining gateway may exit (`workers.drain.DrainingServer`)."""
        return self.pending == 0

    def enter(self) -> None:
        self.pending += 1

    def leave(self) -> None:
        self.pending -= 1

    def open_workers(self, workers: list[W]) -> list[W]:
        """The candidates whose queue has room."""
        bound = self.config.max_queue_per_worker
        return [w for w in workers if w.queued() < bound]

    def full(self, n: int) -> Refusal:
        return Refusal(
            503,
            OVERLOADED,
            f"all {n} candidate workers have {self.config.max_queue_per_worker} requests queued; retry later",
            self.config.retry_after_s,
        )
