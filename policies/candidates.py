"""Who may serve a request alone, and tie-breaks that every gateway replica agrees on."""

import zlib
from collections.abc import Callable, Sequence
from typing import TypeVar

from policies.api import DECODE, MIXED, FleetView, RequestView, Route, WorkerView
from policies.predict import hit_tokens

NO_WORKERS = "no healthy workers"

T = TypeVar("T")


def serving_workers(fleet: FleetView) -> tuple[WorkerView, ...]:
    """Workers a P/D-unaware policy may send a whole request to: the mixed ones, or the decode
    ones when there are no mixed (a decode worker can prefill for itself). Prefill-role workers
    never serve a request alone: nothing would decode it."""
    return fleet.by_role(MIXED) or fleet.by_role(DECODE)


def request_key(req: RequestView) -> int:
    """What ties are broken by: the first block hash, so requests sharing a prefix tie-break
    alike and every replica (same tokens, same hash) reaches the same answer."""
    return req.block_hashes[0] if req.block_hashes else 0


def stable_hash(key: int | str, worker_id: str) -> int:
    """A per-(key, worker) number identical in every process; Python's `hash` of a str is
    salted per process, so two gateway replicas would break ties differently."""
    return zlib.crc32(f"{key}/{worker_id}".encode())


def cheapest(key: int, items: Sequence[T], scores: Sequence, name: Callable[[T], str] = lambda w: w.worker_id) -> T:  # type: ignore[attr-defined]
    """The item with the lowest score; ties go by `stable_hash(key, name)`, then by name. Only
    tied items are hashed: hashing every worker was most of a cheap policy's decision time."""
    low = min(scores)
    tied = [item for item, score in zip(items, scores) if score == low]
    if len(tied) == 1:
        return tied[0]
    return min(tied, key=lambda item: (stable_hash(key, name(item)), name(item)))


def route_to(req: RequestView, w: WorkerView, reason: str = "", **info) -> Route:
    """A single-worker route carrying the prefix-cache hit it expects and why it was chosen."""
    return Route(worker=w.worker_id, predicted_cached_tokens=hit_tokens(req, w), info=info, reason=reason)
