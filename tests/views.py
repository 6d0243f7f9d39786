"""Request, worker and fleet views for policy and prediction tests."""

from policies.api import FleetView, RequestView, WorkerView
from workers.kv.cost_model import CostModel

COST = CostModel()


def req(num_tokens: int = 1024, **kw) -> RequestView:
    return RequestView(
        request_id="r", num_tokens=num_tokens, block_hashes=tuple(range(1000, 1000 + num_tokens // 16)), **kw
    )


def worker(wid: str, **kw) -> WorkerView:
    """A view with the default cost model unless given another (or None)."""
    kw.setdefault("cost", COST)
    return WorkerView(worker_id=wid, **kw)


def fleet(*workers: WorkerView) -> FleetView:
    return FleetView(workers=workers)
