"""Retrying a request that a worker failed before its answer was committed to the client.

Until the client has seen a byte of the answer (a non-streaming response, or a stream before
its first token event) the request can go to another worker as if the first had never been
tried. Each retry waits a backoff first, doubling from `backoff_s` with jitter (so requests
that failed together do not return together), capped at `max_backoff_s`.
"""

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 2
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def delay(self, retry: int, rng: random.Random = random._inst) -> float:
        """Seconds to wait before retry number `retry` (1, 2, ...)."""
        base = min(self.backoff_s * 2 ** (retry - 1), self.max_backoff_s)
        return base * rng.uniform(0.5, 1.0)
