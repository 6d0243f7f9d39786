"""What a router has sent where, before the workers' KV events show it.

The residency index learns a prompt's blocks from the worker's events once its prefill has
committed them; a request for the same prefix that arrives meanwhile finds no holder and is
placed as cold, onto whichever worker looks emptiest: a second copy of the prefix from the
start. A router that counts its own sends (as sglang's and vllm's cache_aware keep a tree of
what they sent) sees the holder at once.
"""

from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from policies.api import FleetView, RequestView, Route, WorkerView
from policies.predict import hit_tokens
from policies.window import TimedWindow


class RoutedPrefixes:
    """The full blocks of the prompts routed in the last `window_s` seconds, each held by the
    worker first sent it. `recall` raises a worker's `matched_blocks` to what it was sent of a
    prompt no worker's index match shows yet; `pending_blocks` is how many distinct blocks a
    worker was sent first in the window. The window is a few polls: by then the prefill has
    run and its events have arrived. A worker whose residency the index has replaced since
    (`residency_epoch`: its cache cleared, a resync, a restart) holds none of what it was sent."""

    def __init__(self, window_s: float = 1.0) -> None:
        # block hash -> (worker, its residency epoch then, when first sent)
        self.first: dict[int, tuple[str, int, float]] = {}
        self.sent: TimedWindow[tuple[int, ...]] = TimedWindow(window_s)  # the blocks first sent, by routing
        self.pending: Counter[str] = Counter()

    def route(self, choose: Callable[[RequestView, FleetView], Route], req: RequestView, fleet: FleetView) -> Route:
        """`choose`'s route for `req` among `fleet` as recalled, remembered where it sends the
        prompt (the prefill worker of a P/D pair). The memory steers the choice; a single
        worker's predicted cached tokens stay the index's, so they keep meaning what the worker
        is known to hold (the memory only guesses that an earlier prompt's prefill will have
        committed by the time this one runs)."""
        route = choose(req, self.recall(req, fleet))
        worker = route.worker
        if worker is None:
            return route
        if route.prefill is None:
            route = replace(route, predicted_cached_tokens=hit_tokens(req, _worker(fleet, worker)))
        self.remember(req, _worker(fleet, route.prefill or worker), fleet.now)
        return route

    def recall(self, req: RequestView, fleet: FleetView) -> FleetView:
        """`fleet` with each worker's match raised to the blocks of `req` it was sent first,
        while the index shows none of the prompt anywhere: once it shows some, it knows better
        (a worker may have evicted what it was sent)."""
        self.expire(fleet.now)
        if any(w.matched_blocks for w in fleet.workers):
            return fleet
        epochs = {w.worker_id: w.residency_epoch for w in fleet.workers}
        sent: dict[str, int] = {}
        for n, h in enumerate(req.block_hashes, 1):
            entry = self.first.get(h)
            if entry is None or epochs.get(entry[0]) != entry[1]:  # its cache was cleared since
                break
            sent[entry[0]] = n
        if not sent:
            return fleet
        return replace(fleet, workers=tuple(_raised(w, sent.get(w.worker_id, 0)) for w in fleet.workers))

    def remember(self, req: RequestView, w: WorkerView, now: float) -> None:
        """Record that `req` was sent to `w` at `now` (`TimedWindow.add`: another replica's
        routing may come late): its full blocks but the last one, which the worker never takes
        from its cache. What left the window goes first: a replica that only hears where the
        others sent prompts holds no more than its window of them."""
        self.expire(now)
        hashes = req.block_hashes[: max(0, req.num_tokens - 1) // w.block_size]
        new = tuple(h for h in hashes if h not in self.first)
        at = self.sent.add(new, now)
        for h in new:
            self.first[h] = (w.worker_id, w.residency_epoch, at)
        self.pending[w.worker_id] += len(new)

    def pending_blocks(self, worker_id: str) -> int:
        return self.pending[worker_id]

    def expire(self, now: float) -> None:
        for hashes in self.sent.expire(now):
            for h in hashes:
                worker_id, _, _ = self.first.pop(h)
                self.pending[worker_id] -= 1


def _worker(fleet: FleetView, worker_id: str) -> WorkerView:
    return next(w for w in fleet.workers if w.worker_id == worker_id)


def _raised(w: WorkerView, blocks: int) -> WorkerView:
    return replace(w, matched_blocks=blocks) if blocks > w.matched_blocks else w
