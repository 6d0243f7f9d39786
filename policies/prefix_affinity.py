"""Prefix affinity: follow the longest cached prefix, unless that worker is overloaded."""

from policies.api import FleetView, RequestView, Route, WorkerView
from policies.candidates import NO_WORKERS, cheapest, request_key, route_to, serving_workers
from policies.pd import PdDecider
from policies.predict import cached_tokens, hit_tokens
from policies.routed import RoutedPrefixes


class PrefixAffinity:
    """Picks the worker with the longest cached prefix among those whose load is within
    `max(slack_abs, slack_rel * min_load) + slack_per_block * the longest hit's blocks` of the
    least-loaded worker.

    The bound is per candidate, not one fleet-wide imbalance switch: one hot worker loses its
    affinity traffic while the others keep theirs. A longer hit earns more imbalance: sending
    it elsewhere copies the prefix into a second KV pool, where it crowds out running requests
    for as long as both copies are read (a 2048-token prefix is an eighth of a 16k-token pool).
    What this router sent counts as cached where it went for `routed_window_s` (until the
    workers' KV events show it: `policies.routed`; 0 turns that off), so a prefix's second
    request follows its first though the first has not been prefilled yet. When nothing
    matches within the bound, the prompt is a new prefix: among the workers it could stay on
    were it a hit of its own length, it goes to the one sent the fewest new blocks in that
    window, then the least loaded, as cache_aware sends it to its smallest tree; by load alone,
    prefixes arriving together piled onto one worker whose pool then could not hold them (the
    index's own count is left out: it moves with every decode block a worker commits, so it
    would tie routing to the timing of its events).
    With prefill and decode workers, a request `policies.pd` judges worth splitting (no
    worker holds enough of it) goes to the pair predicted to answer first.
    """

    name = "prefix_affinity"

    def __init__(
        self,
        slack_abs: int = 4,
        slack_rel: float = 0.5,
        pd_min_uncached_tokens: int = 512,
        slack_per_block: float = 0.25,
        routed_window_s: float = 1.0,
    ) -> None:
        self.slack_abs = slack_abs
        self.slack_rel = slack_rel
        self.slack_per_block = slack_per_block
        self.pd = PdDecider(pd_min_uncached_tokens)
        self.routed = RoutedPrefixes(routed_window_s) if routed_window_s > 0 else None

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        return self.routed.route(self.choose, req, fleet) if self.routed else self.choose(req, fleet)

    def observe(self, req: RequestView, w: WorkerView, now: float) -> None:
        """Another gateway replica sent `req`'s prompt to `w` at `now` (`Observer`)."""
        if self.routed:
            self.routed.remember(req, w, now)

    def choose(self, req: RequestView, fleet: FleetView) -> Route:
        pair = self.pd.best_pair(req, fleet)
        if pair is not None:
            return pair.route(req)
        workers = serving_workers(fleet)
        if not workers:
            return Route(reject=NO_WORKERS)
        loads = [w.load for w in workers]
        hit = [cached_tokens(req, w) if w.matched_blocks else 0 for w in workers]
        min_load = min(loads)
        longest = max(h / w.block_size for h, w in zip(hit, workers))
        bound = min_load + max(self.slack_abs, self.slack_rel * min_load) + self.slack_per_block * longest
        key = request_key(req)
        hits = [(w, load, h) for w, load, h in zip(workers, loads, hit) if h and load <= bound]
        if hits:
            w = cheapest(key, [w for w, _, _ in hits], [(-h, load) for _, load, h in hits])
            reason = f"longest cached prefix ({hit_tokens(req, w)} tokens) among workers with load <= {bound:g}"
        else:
            far = bound + self.slack_per_block * len(req.block_hashes)
            near = [(w, load) for w, load in zip(workers, loads) if load <= far]
            w = cheapest(key, [w for w, _ in near], [(self.sent_blocks(w), load) for w, load in near])
            reason = f"no cached prefix within load {bound:g}: the worker sent the fewest new blocks"
        return route_to(req, w, reason=reason, load_bound=bound)

    def sent_blocks(self, w: WorkerView) -> int:
        """New blocks this router sent `w` first within its window (0 without one)."""
        return self.routed.pending_blocks(w.worker_id) if self.routed else 0
