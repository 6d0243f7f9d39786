"""SLO goodput: route where the request is predicted to meet its TTFT and TPOT targets at the
least cost to the fleet, to one worker or to a (prefill, decode) pair; reject when nowhere can.

Goodput is a fleet-wide quantity. Sending every request where it has the most room to spare
spreads each prefix over every worker: each one then recomputes and caches every prefix, and
the fleet runs out of compute and cache long before it needs to. So among the candidates that
meet the SLOs the one that computes the fewest prompt tokens wins (a cache hit is capacity
saved for later requests); only when the cache holders are predicted to miss does the request
go elsewhere, to the candidate with the most room. A request that will miss its SLO anyway only steals capacity from ones
that would not, so rejecting it early (with the reason) is what maximises goodput.
"""
from policies.api import DECODE, MIXED, PREFILL, FleetView, RequestView, Route, WorkerView
from policies.candidates import NO_WORKERS, cheapest, request_key
from policies.predict import (cached_tokens, import_ttft_tpot_ms, transfer_ms, ttft_ms, ttft_tpot_ms,
                              uncached_tokens)


class SloGoodput:
    """Predicts TTFT and TPOT per candidate and its headroom, the smaller of
    `slack_ttft / slo_ttft` and `slack_tpot / slo_tpot` (>= 0: it meets its SLOs). Among the
    candidates with headroom >= `margin`, takes the one that prefills the fewest tokens, then
    the most headroom; with none that safe, the most headroom; with none >= 0, rejects.
    A positive `margin` demands that much spare headroom before cache affinity counts, trading
    cache hits for a buffer against prediction error; in simulation (8 workers, shared-prefix)
    0 did best: 0.1 spread prefixes and fell from 0.88 to 0.80 attainment at 250 req/s. SLOs come
    from the request, else from `ttft_ms` / `tpot_ms`.

    P/D: with prefill and decode workers in the fleet, each decode worker is paired with its
    best prefill worker (TTFT = prefill queue + prefill of what P lacks + transfer of what D
    lacks + D's last partial block; TPOT from D's decode load); mixed workers stay single
    candidates. Disaggregation is conditional: when the best decode or mixed worker lacks fewer
    than `pd_min_uncached_tokens` tokens, moving KV is not worth it and decode workers prefill
    for themselves as single candidates.
    """
    name = "slo_goodput"

    def __init__(self, ttft_ms: float = 2000.0, tpot_ms: float = 200.0,
                 pd_min_uncached_tokens: int = 512, margin: float = 0.0) -> None:
        self.ttft_ms = ttft_ms
        self.tpot_ms = tpot_ms
        self.margin = margin
        self.pd_min_uncached_tokens = pd_min_uncached_tokens

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        slo_ttft = req.slo_ttft_ms or self.ttft_ms
        slo_tpot = req.slo_tpot_ms or self.tpot_ms
        mixed, prefill, decode = fleet.by_role(MIXED), fleet.by_role(PREFILL), fleet.by_role(DECODE)
        if not mixed and not decode:
            return Route(reject=NO_WORKERS)
        split = bool(prefill and decode) and self.disaggregate(req, mixed + decode)
        servers = mixed if split else mixed + decode
        choice = None if split else self.safe_hit(req, servers, slo_ttft, slo_tpot)
        if choice is None:
            candidates = [(*ttft_tpot_ms(req, w), None, w) for w in servers]
            if split:
                candidates += self.pairs(req, prefill, decode)
            choice = self.best(req, candidates, slo_ttft, slo_tpot)
        headroom, ttft, tpot, p, d = choice
        if headroom < 0:
            return Route(reject=f"no {'P/D pair or ' if split else ''}worker meets the SLOs "
                                f"(ttft {slo_ttft:.0f} ms, tpot {slo_tpot:.0f} ms): best is "
                                f"{_name(p, d)} at ttft {ttft:.0f} ms, tpot {tpot:.1f} ms",
                         info={"headroom": headroom})
        return Route(worker=d.worker_id, prefill=p.worker_id if p else None,
                     predicted_cached_tokens=cached_tokens(req, p or d),
                     predicted_ttft_ms=ttft, predicted_tpot_ms=tpot, info={"headroom": headroom})

    def best(self, req: RequestView, candidates: list[tuple], slo_ttft: float,
             slo_tpot: float) -> tuple[float, float, float, WorkerView | None, WorkerView]:
        """(headroom, ttft, tpot, P, D) of the best of `candidates`, given as (ttft, tpot, P, D)."""
        scored = [(_headroom(t, o, slo_ttft, slo_tpot), t, o, p, d) for t, o, p, d in candidates]
        return cheapest(request_key(req), scored, self.scores(req, scored), name=lambda c: _name(c[3], c[4]))

    def safe_hit(self, req: RequestView, servers: tuple[WorkerView, ...], slo_ttft: float,
                 slo_tpot: float) -> tuple | None:
        """The decision, when a worker holding part of the prompt is predicted safe: it prefills
        fewer tokens than any worker holding none, so those cannot win and need no prediction.
        With prefix sharing that is most requests, and a few predictions replace one per worker
        (128 of them, for every request, in a large simulated fleet)."""
        n = req.num_tokens
        hits = [w for w in servers if w.matched_blocks and uncached_tokens(req, w) < n]
        if not hits:
            return None
        choice = self.best(req, [(*ttft_tpot_ms(req, w), None, w) for w in hits], slo_ttft, slo_tpot)
        return choice if choice[0] >= max(self.margin, 0.0) else None

    def scores(self, req: RequestView, scored: list[tuple]) -> list[tuple]:
        """Lower is better: safe candidates first, then those only predicted to meet the SLOs,
        then the rest; within the first two by prefill work, then headroom."""
        return [(0 if h >= self.margin else 1, uncached_tokens(req, p or d), -h) if h >= 0 else (2, 0, -h)
                for h, _, _, p, d in scored]

    def disaggregate(self, req: RequestView, servers: tuple[WorkerView, ...]) -> bool:
        """Whether even the best-cached worker that could serve alone has enough to prefill."""
        return min(uncached_tokens(req, w) for w in servers) >= self.pd_min_uncached_tokens

    def pairs(self, req: RequestView, prefill: tuple[WorkerView, ...],
              decode: tuple[WorkerView, ...]) -> list[tuple[float, float, WorkerView, WorkerView]]:
        """(ttft, tpot, P, D) for each decode worker D with its fastest prefill worker P.

        The transfer time depends on P only through its link speed and KV size, so per such
        class only the P with the smallest TTFT can be best: pairs cost O(classes x decode),
        not O(prefill x decode).
        """
        fastest: dict[tuple[float, int], tuple[float, str, WorkerView]] = {}
        for p in prefill:
            entry = (ttft_ms(req, p), p.worker_id, p)
            link = (p.transfer_gbps, p.kv_bytes_per_token)
            if link not in fastest or entry[:2] < fastest[link][:2]:
                fastest[link] = entry
        out = []
        for d in decode:
            tail, tpot = import_ttft_tpot_ms(req, d)
            ttft, p = min(((t + transfer_ms(req, p, d) + tail, p) for t, _, p in fastest.values()),
                          key=lambda c: (c[0], c[1].worker_id))
            out.append((ttft, tpot, p, d))
        return out


def _headroom(ttft: float, tpot: float, slo_ttft: float, slo_tpot: float) -> float:
    """The tighter normalised slack: below 0 means an SLO is missed."""
    return min((slo_ttft - ttft) / slo_ttft, (slo_tpot - tpot) / slo_tpot)


def _name(p: WorkerView | None, d: WorkerView) -> str:
    return f"{p.worker_id}>{d.worker_id}" if p else d.worker_id
