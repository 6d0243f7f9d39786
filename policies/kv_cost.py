"""KV cost: minimise the prefill work a request causes plus the decode load it joins."""

from policies.api import FleetView, RequestView, Route, WorkerView
from policies.candidates import NO_WORKERS, cheapest, request_key, route_to, serving_workers
from policies.pd import PdDecider
from policies.predict import queued_tokens, uncached_tokens


class KvCost:
    """Scores each worker in prefill-token equivalents and takes the cheapest:

        cost = prefill_weight * uncached_tokens + queued_prefill_tokens + alpha * running

    A cache hit saves prefill work exactly as an empty queue does, so both count in tokens;
    `alpha` is how many prefill tokens one running decode is worth (it slows every step).
    With prefill and decode workers, a request `policies.pd` judges worth splitting goes to
    the pair predicted to answer first.
    """

    name = "kv_cost"

    def __init__(self, prefill_weight: float = 1.0, alpha: float = 64.0, pd_min_uncached_tokens: int = 512) -> None:
        self.prefill_weight = prefill_weight
        self.alpha = alpha
        self.pd = PdDecider(pd_min_uncached_tokens)

    def cost(self, req: RequestView, w: WorkerView) -> float:
        return self.prefill_weight * uncached_tokens(req, w) + queued_tokens(req, w) + self.alpha * w.running

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        pair = self.pd.best_pair(req, fleet)
        if pair is not None:
            return pair.route(req)
        workers = serving_workers(fleet)
        if not workers:
            return Route(reject=NO_WORKERS)
        w = cheapest(request_key(req), workers, [(self.cost(req, w), w.load) for w in workers])
        cost = self.cost(req, w)
        return route_to(
            req,
            w,
            reason=f"lowest cost: {cost:.0f} prefill-token equivalents ({uncached_tokens(req, w)} "
            f"uncached, {queued_tokens(req, w)} queued, {w.running} running)",
            cost=cost,
        )
