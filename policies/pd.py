"""Prefill/decode disaggregation as a decision any policy can make: whether a request is worth
splitting over a prefill worker and a decode worker, and which pairs can serve it.

Moving KV costs a transfer and a second request; it pays only when there is much to prefill.
So a request is split only when the fleet has both roles and even the best-cached worker that
could serve it alone (mixed or decode) lacks at least `min_uncached_tokens` prompt tokens.
"""

from dataclasses import dataclass

from policies.api import DECODE, MIXED, PREFILL, FleetView, RequestView, Route, WorkerView
from policies.predict import (
    cached_tokens,
    exposed_transfer_ms,
    hit_tokens,
    import_ttft_tpot_ms,
    ttft_ms,
    uncached_tokens,
)


@dataclass(frozen=True)
class Pair:
    """A prefill worker and a decode worker for one request, with the predicted TTFT (P's
    queue and prefill, what the transfer of what D lacks adds after it, D's last partial
    block) and TPOT on D."""

    prefill: WorkerView
    decode: WorkerView
    ttft_ms: float
    tpot_ms: float

    @property
    def name(self) -> str:
        return f"{self.prefill.worker_id}>{self.decode.worker_id}"

    def route(self, req: RequestView, **info) -> Route:
        """The route to this pair, carrying the prefill worker's expected cache hit."""
        return Route(
            worker=self.decode.worker_id,
            prefill=self.prefill.worker_id,
            predicted_cached_tokens=hit_tokens(req, self.prefill),
            predicted_ttft_ms=self.ttft_ms,
            predicted_tpot_ms=self.tpot_ms,
            info=info,
            reason=f"disaggregated: {self.name} has the lowest predicted ttft ({self.ttft_ms:.0f} ms; "
            f"{hit_tokens(req, self.prefill)} tokens cached on the prefill worker)",
        )


class PdDecider:
    """`split` says whether to disaggregate; `pairs` gives every decode worker with its fastest
    prefill worker; `best_pair`, for a request worth splitting, the pair with the lowest
    predicted TTFT (then TPOT, then name), for policies that do not weigh SLOs themselves."""

    def __init__(self, min_uncached_tokens: int = 512) -> None:
        self.min_uncached_tokens = min_uncached_tokens

    def split(self, req: RequestView, fleet: FleetView) -> bool:
        """Whether the fleet has prefill and decode workers, `req` asks for one sequence (what a
        KV handoff carries) and even the best-cached worker that could serve it alone has at
        least `min_uncached_tokens` to prefill."""
        prefill, servers = fleet.by_role(PREFILL), fleet.by_role(MIXED, DECODE)
        if not prefill or not fleet.by_role(DECODE) or req.choices != 1:
            return False
        return min(uncached_tokens(req, w) for w in servers) >= self.min_uncached_tokens

    def pairs(self, req: RequestView, fleet: FleetView) -> list[Pair]:
        """Each decode worker D with its fastest prefill worker P.

        What the transfer adds depends on P's own prefill time (its export batches overlap
        it), not only on its link, so every (P, D) is priced: each P's TTFT once, then a
        closed form per pair."""
        heads = [(ttft_ms(req, p), p) for p in fleet.by_role(PREFILL)]
        out = []
        for d in fleet.by_role(DECODE):
            tail, tpot = import_ttft_tpot_ms(req, d)
            ttft, p = min(
                ((t + exposed_transfer_ms(req, p, d, t) + tail, p) for t, p in heads),
                key=lambda c: (c[0], c[1].worker_id),
            )
            out.append(Pair(p, d, ttft, tpot))
        return out

    def warm_pairs(self, req: RequestView, servers: tuple[WorkerView, ...]) -> list[Pair]:
        """Pairs that warm another worker with a prefix one worker holds: the holder (the
        worker holding the most of the prompt) prefills what it lacks and ships every full
        block to each worker that holds at least `min_uncached_tokens` less. For when the
        holder cannot serve the request itself within its SLOs: the prefix then moves at the
        link's speed instead of being computed again, and the second worker holds it for the
        requests after."""
        if len(servers) < 2 or req.choices != 1:
            return []
        holder = min(servers, key=lambda w: (-cached_tokens(req, w), w.worker_id))
        held = cached_tokens(req, holder)
        if held < self.min_uncached_tokens:
            return []
        head, out = ttft_ms(req, holder), []
        for d in servers:
            if d is not holder and held - cached_tokens(req, d) >= self.min_uncached_tokens:
                tail, tpot = import_ttft_tpot_ms(req, d)
                out.append(Pair(holder, d, head + exposed_transfer_ms(req, holder, d, head) + tail, tpot))
        return out

    def best_pair(self, req: RequestView, fleet: FleetView) -> Pair | None:
        """The pair predicted to answer first when `req` is worth splitting, else None."""
        if not self.split(req, fleet):
            return None
        return min(self.pairs(req, fleet), key=lambda c: (c.ttft_ms, c.tpot_ms, c.name), default=None)
