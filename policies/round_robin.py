"""Round robin: the cache-blind baseline every other policy is measured against."""

from policies.api import FleetView, RequestView, Route
from policies.candidates import NO_WORKERS, route_to, serving_workers


class RoundRobin:
    """Cycles through the serving workers in worker-id order, so the cycle does not depend on
    the order the gateway lists them in."""

    name = "round_robin"

    def __init__(self) -> None:
        self.turn = 0

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        workers = sorted(serving_workers(fleet), key=lambda w: w.worker_id)
        if not workers:
            return Route(reject=NO_WORKERS)
        w = workers[self.turn % len(workers)]
        self.turn += 1
        return route_to(req, w, reason=f"next in turn ({self.turn % len(workers) or len(workers)} of {len(workers)})")
