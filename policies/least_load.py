"""Least load: the queue-aware, cache-blind baseline."""

from policies.api import FleetView, RequestView, Route
from policies.candidates import NO_WORKERS, cheapest, request_key, route_to, serving_workers


class LeastLoad:
    """Sends each request to the worker with the fewest requests, then the least queued
    prefill; ties go by a hash every gateway replica computes alike."""

    name = "least_load"

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        workers = serving_workers(fleet)
        if not workers:
            return Route(reject=NO_WORKERS)
        w = cheapest(request_key(req), workers, [(w.load, w.queued_prefill_tokens) for w in workers])
        return route_to(
            req, w, reason=f"least loaded: {w.load} requests, {w.queued_prefill_tokens} queued prefill tokens"
        )
