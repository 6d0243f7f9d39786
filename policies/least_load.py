"""Least load: the queue-aware, cache-blind baseline."""
from policies.api import FleetView, RequestView, Route
from policies.candidates import NO_WORKERS, request_key, route_to, serving_workers, stable_hash


class LeastLoad:
    """Sends each request to the worker with the fewest requests, then the least queued
    prefill; ties go by a hash every gateway replica computes alike."""
    name = "least_load"

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        workers = serving_workers(fleet)
        if not workers:
            return Route(reject=NO_WORKERS)
        key = request_key(req)
        w = min(workers, key=lambda w: (w.load, w.queued_prefill_tokens,
                                        stable_hash(key, w.worker_id), w.worker_id))
        return route_to(req, w)
