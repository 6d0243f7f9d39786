"""A completion's or chat's tries as the policy routes them (the `Way` of gateway/retry.py):
each try decided among the workers that have not failed the request, entered in the chosen
worker's ledger, and for a P/D route its prefill leg started before the decode leg is sent;
what the record and the trace show of each decision.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from gateway import pd
from gateway.intake import ApiError
from gateway.record import RequestRecord
from gateway.tokenize import Prepared
from gateway.worker import Worker
from policies.api import FleetView, RequestView
from policies.api import Route as Decision
from policies.ledger import Sent
from policies.predict import cached_tokens

if TYPE_CHECKING:
    from gateway.app import Gateway


@dataclasses.dataclass
class Routing:
    """A completion's or chat's tries (the `Way` of gateway/retry.py): each routed by the
    policy, entered in the worker's ledger, a P/D route's prefill leg started before the decode
    leg is sent. `route` and `prefill` are the current try's."""

    gateway: Gateway
    request: Request
    kind: str
    raw: bytes
    model: str
    prep: Prepared | None
    view: RequestView
    rec: RequestRecord
    sent: dict[str, str]  # the request's headers to a worker
    route: Decision = dataclasses.field(init=False)
    prefill: Worker | None = dataclasses.field(init=False)

    def pick(self, exclude: set[str]) -> Worker | None:
        """The policy's worker among those not in `exclude`, its route on the record. After a
        failure (`exclude` not empty) a refusal is None: the answer is the request's failure."""
        gw, rec, view = self.gateway, self.rec, self.view
        try:
            with rec.trace.phase("route"):
                w, self.route, self.prefill, seen = gw.decide(view, self.model, exclude)
        except ApiError:
            if not exclude:
                raise
            return None
        route = self.route
        rec.trace.set(policy=gw.policy.name, worker=w.worker_id, prefill_worker=route.prefill)
        rec.prefill_worker = route.prefill
        rec.route_reason, rec.candidates = route.reason, candidates_summary(view, seen)
        rec.predicted_cached = (
            route.predicted_cached_tokens
            if self.prefill is None
            else pd.expected_cached(view.num_tokens, w.state.get("block_size", 16))
        )
        return w

    def begin(self, w: Worker) -> None:
        """`w`'s count and ledger take the request; the other replicas' policies hear where its prefill runs."""
        rec, view = self.rec, self.view
        self.gateway.fleet.begin(w, rec.request_id, ledger_entry(view, self.route, w, self.prep))
        self.gateway.fleet.routed(self.prefill or w, rec.request_id, view.block_hashes, view.num_tokens, time.time())

    def end(self, w: Worker) -> None:
        self.gateway.fleet.end(w, self.rec.request_id)

    async def attempt(self, w: Worker) -> Response:
        """One try on `w`, after the prefill leg on `prefill` for a P/D route (gateway/exchange.py)."""
        gw, p, route = self.gateway, self.prefill, self.route
        leg = self.sent if p is None or not gw.internal_token else pd.leg_headers(self.sent, gw.internal_token)
        payload, span = (
            (self.raw, None)
            if p is None
            else gw.exchange.start_prefill(p, w, self.kind, self.raw, leg, self.rec, route)
        )
        with self.rec.trace.client("upstream", leg, span, worker=w.worker_id) as sent:
            return await gw.exchange.attempt(
                self.request, w, route, self.view, self.prep, self.kind, payload, sent, self.rec
            )

    def headers(self, w: Worker | None) -> dict[str, str]:
        """The gateway's headers: about `w`'s try (a 499), or none's (a worker's 503 passed on)."""
        if w is None:
            return self.gateway.headers()
        return self.gateway.headers(w.worker_id, self.route.predicted_cached_tokens)


MAX_CANDIDATES_SHOWN = 8


def ledger_entry(view: RequestView, route: Decision, w: Worker, prep: Prepared | None) -> Sent:
    """The ledger entry of a request sent to `w` (`policies.ledger`): a non-streaming answer
    shows no first token, so it counts as started when its TTFT was predicted."""
    streamed = prep.parsed.stream if prep else True
    started = None if streamed else time.time() + (route.predicted_ttft_ms or 0.0) / 1000.0
    return Sent.routed(view, route, w.base.block_size if w.base else 16, w.hash_ratio, started)


def candidates_summary(view: RequestView, fleet: FleetView) -> str:
    """'w0 cached=128 load=1, w1 cached=0 load=0': each candidate's cached prefix for this
    request (tokens) and its load (requests), the most cached first, at most 8 of them."""
    rows = sorted(((cached_tokens(view, w), w.load, w.worker_id) for w in fleet.workers), key=lambda r: (-r[0], r[1]))
    return ", ".join(f"{wid} cached={c} load={load}" for c, load, wid in rows[:MAX_CANDIDATES_SHOWN])
