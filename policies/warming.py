"""Hot prefixes beyond one worker: when to warm a second worker with a prefix by KV import.

A prefix's holder serves its requests from cache. Once their demand outgrows it, the worker
that serves the overflow computes the prefix again cold, and only after the holder's predicted
TTFT or TPOT has passed the SLO: a miss predicted, the requests just before it already late.
Shipping the prefix from the holder to a second worker (a P/D pair of two mixed workers,
`PdDecider.warm_pairs`) costs that worker's pool the prefix once, and every later request of
the prefix reads the copy: so the copy is charged to the demand, not to the one request that
carries it (the pair pays `pool_share` of what the request adds).

A prefix has outgrown its holders when either
- the best-cached holder's predicted headroom for the request (TTFT with its queue and its pool
  wait, and TPOT) is below `below`; or
- the prefix's recent demand (requests per second over the window) is over `load` of what the
  workers holding all of it serve: each holds `fits` requests alike at once, for a life
  (`predict.pool_batch`), so it serves `fits / life` of them per second (Little's law).
Whether the copy is made is the score's call: the warm pair competes with the holder and with
a cold copy on the same worker, its TTFT counting the holder's queue, its turn in the holder's
pool and the transfer, so it wins only where importing answers sooner than recomputing.
Measured in the simulator (4 H200 workers, 1024-block pools, 5 seeds) warming pays nowhere: a
2048-token prefix recomputes in ~21 ms, and a holder that has outgrown its prefix has a full
pool its pair's prefill waits in; the score already spreads a hot prefix by headroom first.
Fired ahead of that (`below` 0.5 or `load` 0.8) the few pairs chosen cost attainment past
capacity (80% of requests on one prefix, 5 seeds: 0.895 / 0.832 at 40 / 48 req/s against
0.903 / 0.842 without warming); so by default it fires only where warming is needed, `below` 0 (a predicted
miss) and `load` 1.0 (the demand past what the holders serve), where it equals no warming.
"""

from collections.abc import Sequence

from policies.api import RequestView, WorkerView
from policies.predict import hit_blocks, pool_batch
from policies.window import TimedCounts


class PrefixWarmer:
    """Counts each prefix's requests over the last `window_s` seconds (a prefix: the chain of
    blocks its best-cached holder holds, named by its last block's hash) and says when one has
    outgrown its holders (see the module)."""

    def __init__(self, window_s: float = 5.0, below: float = 0.0, load: float = 1.0) -> None:
        self.below = below
        self.load = load
        self.requests: TimedCounts[int] = TimedCounts(window_s)

    def prefix(self, req: RequestView, holder: WorkerView) -> int | None:
        """The prefix of `req` that `holder` holds, named by its last block's hash; None where
        it holds none."""
        blocks = hit_blocks(req, holder)
        return req.block_hashes[blocks - 1] if blocks else None

    def add(self, key: int, now: float) -> None:
        """Count a request for prefix `key` at `now` (this router's or another replica's,
        `TimedCounts.add`)."""
        self.requests.add(key, now)

    def outgrown(
        self, key: int, req: RequestView, holder: WorkerView, headroom: float, servers: Sequence[WorkerView]
    ) -> bool:
        """Whether prefix `key`, which `holder` holds of `req`, has outgrown its holders among
        `servers` (`headroom`: `holder`'s predicted headroom for `req`)."""
        blocks = hit_blocks(req, holder)
        holders = [w for w in servers if hit_blocks(req, w) >= blocks]
        return headroom < self.below or self.demand(key, req, holders) > self.load

    def demand(self, key: int, req: RequestView, holders: Sequence[WorkerView]) -> float:
        """The prefix's requests per second over what its holders serve at once: each holds
        `fits` requests alike for a life (`predict.pool_batch`)."""
        rates = [
            fits / life_ms for fits, life_ms in (pool_batch(req, w, alike=True) for w in holders if w.total_blocks > 0)
        ]
        if not rates or self.requests.window_s <= 0:
            return 0.0
        return self.requests.count[key] / self.requests.window_s / (1000.0 * sum(rates))
