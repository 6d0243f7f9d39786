"""A circuit breaker per worker: stop sending requests to a worker whose requests keep failing.

A worker can pass its health polls and still fail every request sent to it (a broken proxy
path, an engine that errors on every step, a port that accepts and hangs). After `failures`
consecutive failed requests the breaker opens: the worker is no candidate for `cooldown_s`,
doubling with each reopening up to `max_cooldown_s`. Then it is half-open: one trial request
may go; its success closes the breaker, its failure reopens it. Failures are the worker's own
(no connection, timeouts, broken responses, 5xx other than 503); an overloaded or draining
worker's 503 is load, not failure, and leaves the breaker alone. A worker whose health poll
failed (dead, restarted) starts again with a closed breaker when it answers again.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass
class BreakerConfig:
    failures: int = 3
    cooldown_s: float = 2.0
    max_cooldown_s: float = 30.0


@dataclass
class Breaker:
    config: BreakerConfig = field(default_factory=BreakerConfig)
    clock: Callable[[], float] = time.monotonic
    consecutive: int = 0
    opened: int = 0
    until: float = 0.0
    trial: bool = False

    @property
    def state(self) -> str:
        if self.consecutive < self.config.failures:
            return CLOSED
        return OPEN if self.clock() < self.until else HALF_OPEN

    def allows(self) -> bool:
        """Whether the worker may be offered a request now (half-open: while no trial is out)."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self.trial)

    def attempt(self) -> None:
        """A request was sent; in the half-open state it is the one trial."""
        if self.state == HALF_OPEN:
            self.trial = True

    def succeeded(self) -> None:
        self.consecutive, self.opened, self.trial = 0, 0, False

    def reset(self) -> None:
        """The worker came back after its health poll had failed: a new start, a closed breaker."""
        self.succeeded()

    def failed(self) -> bool:
        """Count a failure; True when it opens (or reopens) the breaker."""
        self.trial = False
        self.consecutive += 1
        if self.consecutive < self.config.failures:
            return False
        cooldown = min(self.config.cooldown_s * 2**self.opened, self.config.max_cooldown_s)
        self.opened += 1
        self.until = self.clock() + cooldown
        return True

    def released(self) -> None:
        """A request ended without saying anything about the worker (the client left)."""
        self.trial = False
