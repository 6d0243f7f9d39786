"""An example third-party policy: keep each chat session on one worker.

Load it with `--policy examples/sticky_session.py:StickySession` (or, with the repo root on
`sys.path`, `examples.sticky_session:StickySession`). A session's earlier turns are the
prefix of its next one, so pinning the session keeps its KV cache hot without waiting for
residency events to catch up.
"""

from policies.api import FleetView, RequestView, Route
from policies.candidates import NO_WORKERS, route_to, serving_workers, stable_hash
from policies.prefix_affinity import PrefixAffinity


class StickySession:
    """Rendezvous-hashes `session_id` over the serving workers: every gateway replica picks the
    same worker, and when a worker leaves only its own sessions move. Requests without a
    session fall back to prefix affinity (built with `affinity_kwargs`)."""

    name = "sticky_session"

    def __init__(self, **affinity_kwargs) -> None:
        self.fallback = PrefixAffinity(**affinity_kwargs)

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        if req.session_id is None:
            return self.fallback.route(req, fleet)
        workers = serving_workers(fleet)
        if not workers:
            return Route(reject=NO_WORKERS)
        w = max(workers, key=lambda w: (stable_hash(req.session_id, w.worker_id), w.worker_id))
        return route_to(req, w, session=req.session_id)
