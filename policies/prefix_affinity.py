"""Prefix affinity: follow the longest cached prefix, unless that worker is overloaded."""

from policies.api import FleetView, RequestView, Route
from policies.candidates import NO_WORKERS, cheapest, request_key, route_to, serving_workers
from policies.pd import PdDecider
from policies.predict import cached_tokens, hit_tokens


class PrefixAffinity:
    """Picks the worker with the longest cached prefix among those whose load is within
    `max(slack_abs, slack_rel * min_load)` of the least-loaded worker.

    The bound is per candidate, not one fleet-wide imbalance switch: one hot worker loses its
    affinity traffic while the others keep theirs. When nothing matches, the least-loaded
    worker wins (it is always eligible, and ties among matches go to the lower load).
    With prefill and decode workers, a request `policies.pd` judges worth splitting (no
    worker holds enough of it) goes to the pair predicted to answer first.
    """

    name = "prefix_affinity"

    def __init__(self, slack_abs: int = 4, slack_rel: float = 0.5, pd_min_uncached_tokens: int = 512) -> None:
        self.slack_abs = slack_abs
        self.slack_rel = slack_rel
        self.pd = PdDecider(pd_min_uncached_tokens)

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        pair = self.pd.best_pair(req, fleet)
        if pair is not None:
            return pair.route(req)
        workers = serving_workers(fleet)
        if not workers:
            return Route(reject=NO_WORKERS)
        loads = [w.load for w in workers]
        min_load = min(loads)
        bound = min_load + max(self.slack_abs, self.slack_rel * min_load)
        key = request_key(req)
        hits = [
            (w, load) for w, load in zip(workers, loads) if load <= bound and w.matched_blocks and cached_tokens(req, w)
        ]
        if hits:
            w = cheapest(key, [w for w, _ in hits], [(-cached_tokens(req, w), load) for w, load in hits])
            reason = f"longest cached prefix ({hit_tokens(req, w)} tokens) among workers with load <= {bound:g}"
        else:
            w = cheapest(key, workers, loads)
            reason = f"no cached prefix within load {bound:g}: least loaded ({w.load} requests)"
        return route_to(req, w, reason=reason, load_bound=bound)
