"""SLO goodput: route where the request is predicted to meet its TTFT and TPOT targets at the
least cost to the fleet, to one worker or to a (prefill, decode) pair; reject when nowhere can.

Goodput is a fleet-wide quantity. A cache hit is compute saved, but only as much as the
prefill it skips: on a fast GPU a 512-token shared system prompt is a few milliseconds, less
than the headroom a busier worker lacks, so a new chat session goes where there is room and
every worker warms up; a 2048-token document is worth more than a few requests of imbalance,
so it stays where it is cached until that worker's predicted TTFT or TPOT would miss. A hit
also saves KV pool room, which on a fast GPU is worth far more than its prefill: a second copy
of a 2048-token prefix takes an eighth of a 16k-token pool, and copies spread over the fleet
crowd out running requests until every pool is full and requests that would meet their SLOs
are refused. A KV
pool that cannot hold what is queued ahead plus the request preempts running requests, which
recompute their whole context: past that point admissions feed a thrash that drags every
request on the worker past its SLO. A request predicted to miss only steals capacity from
ones that would not, so rejecting it early (with the reason) is what keeps goodput at overload.
"""

from dataclasses import replace

from policies.api import DECODE, MIXED, FleetView, RequestView, Route, Tally, WorkerView
from policies.candidates import NO_WORKERS, cheapest, request_key
from policies.footprints import Footprints
from policies.pd import Pair, PdDecider
from policies.refusals import RecentRefusals
from policies.routed import RoutedPrefixes
from policies.warming import PrefixWarmer
from policies.predict import (
    cached_tokens,
    hit_tokens,
    ledger_wait_ms,
    pool_queue_safety,
    pool_queue_wait_ms,
    pool_share,
    prefill_work_ms,
    ttft_tpot_ms,
    uncached_tokens,
)


LEDGER_MARGIN = 1.25  # the ledger's wait counted a quarter long where it stands for the polled one
LEDGER_MAX_SAFETY = 1.4  # refusing over a fifth of its traffic, the router trusts the polled view only


class SloGoodput:
    """Predicts TTFT and TPOT per candidate and its headroom, the smaller of
    `slack_ttft / slo_ttft` and `slack_tpot / slo_tpot` (>= 0: it meets its SLOs); a candidate
    is admissible when its headroom is >= 0. The TTFT includes the wait for a turn in the KV
    pool (`predict.pool_queue_wait_ms`): a full pool frees blocks as its running requests end,
    so it refuses only what would wait past its SLO. That wait is scaled by how much of its
    traffic the router refused in the last `refusal_window_s` (`predict.pool_queue_safety`):
    about as predicted at capacity, doubled far past it, where a polled view is staler than the
    pool it describes. Among admissible candidates with headroom
    >= `margin` (else among all admissible ones) it takes the lowest `prefill work / slo_ttft +
    pool share - headroom` (`predict.pool_share`: the share of the worker's free KV pool the
    uncached prompt takes): cache hits, pool room and spare time traded in one unit. With none
    admissible it rejects.
    A positive `margin` demands that much spare headroom first, a buffer against prediction
    error. SLOs come from the request, else from `ttft_ms` / `tpot_ms`.

    What this router sent counts as cached where it went for `routed_window_s`
    (`policies.routed`, as in `prefix_affinity`; 0 turns that off): a prefix's second request
    follows its first before the workers' KV events show it, and a prompt no worker holds goes,
    among the candidates of the best tier, to the one sent the fewest new blocks in that window,
    as cache_aware sends it to its smallest tree. Placed by the score alone, prefixes arriving
    between polls landed five on one worker and three on another, whose full pools then refused
    their readers.

    Where this router's ledger covers a worker (`predict.ledger_wait_ms`: it sent everything
    in flight there, and sees in its streams how far each request has got) the ledger's wait
    stands beside the polled one, times the refusal-scaled safety and `LEDGER_MARGIN`: on a
    candidate holding as much of the prompt as any, the shorter of the two counts (the polled
    estimate ran twice the waits met on multi-turn chat, where pools turn over every few
    seconds); elsewhere the polled one stays, since a copy of a prefix crowds out cached ones
    the ledger does not price. And a request among the largest `big_share` of the recent ones
    by pool footprint (`policies.footprints`) is refused where the ledger puts its start past
    `big_wait` of its TTFT SLO: when some must be refused, the largest free the most room each.
    Far past capacity (safety over `LEDGER_MAX_SAFETY`) the polled estimate alone decides: the
    ledger assumes the worker serves its pool in turn, and an overcommitted pool preempts.

    P/D (`policies.pd`): when the request is worth splitting, each decode worker paired with its
    fastest prefill worker is a candidate beside the mixed workers, scored alike; otherwise
    decode workers prefill for themselves as single candidates. When the prefix the worker
    holding the most of a prompt holds has outgrown it (`policies.warming.PrefixWarmer`: the
    holder's predicted headroom below `warm_below`, or the prefix's demand over `warm_load` of
    what its holders serve, counted over `warm_window_s`), pairs that ship the prefix
    from it to another mixed worker (`PdDecider.warm_pairs`) compete too, each paying for
    only what the request adds to the copy: a hot prefix spreads by KV import instead of being
    recomputed cold where the import answers sooner (`warm_prefixes=False` turns that off).

    Behind several gateway replicas the three windows over recent traffic (refusals, footprints,
    each prefix's demand) count every replica's decisions (`Tallied`: each route's `Tally`
    reaches the others through Redis), as one router's would.
    """

    name = "slo_goodput"

    def __init__(
        self,
        ttft_ms: float = 2000.0,
        tpot_ms: float = 200.0,
        pd_min_uncached_tokens: int = 512,
        margin: float = 0.0,
        warm_prefixes: bool = True,
        routed_window_s: float = 1.0,
        refusal_window_s: float = 5.0,
        warm_below: float = 0.0,
        warm_load: float = 1.0,
        warm_window_s: float = 5.0,
        ledger_wait: bool = True,
        big_share: float = 0.15,
        big_wait: float = 0.25,
    ) -> None:
        self.routed = RoutedPrefixes(routed_window_s) if routed_window_s > 0 else None
        self.ttft_ms = ttft_ms
        self.tpot_ms = tpot_ms
        self.margin = margin
        self.pd = PdDecider(pd_min_uncached_tokens)
        self.warmer = PrefixWarmer(warm_window_s, warm_below, warm_load) if warm_prefixes else None
        self.refusals = RecentRefusals(refusal_window_s)
        self.safety = pool_queue_safety(0.0)
        self.ledger_wait, self.big_share, self.big_wait = ledger_wait, big_share, big_wait
        self.footprints = Footprints()
        self.now, self.held, self.big = 0.0, 0, False
        self.footprint = 0  # what the decision in progress adds (`Route.tally`)
        self.prefix: int | None = None

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        self.safety = pool_queue_safety(self.refusals.share(fleet.now))
        self.footprint, self.prefix = 0, None
        route = self.routed.route(self.choose, req, fleet) if self.routed else self.choose(req, fleet)
        refused = route.reject is not None
        self.refusals.record(fleet.now, refused)
        return replace(route, tally=Tally(refused, self.footprint, self.prefix))

    def add_tally(self, tally: Tally, now: float) -> None:
        """Another gateway replica's decision (`Tallied`): into the same windows as this one's."""
        self.refusals.record(now, tally.refused)
        if tally.footprint:
            self.footprints.add(tally.footprint)
        if tally.prefix is not None and self.warmer:
            self.warmer.add(tally.prefix, now)

    def observe(self, req: RequestView, w: WorkerView, now: float) -> None:
        """Another gateway replica sent `req`'s prompt to `w` at `now` (`Observer`)."""
        if self.routed:
            self.routed.remember(req, w, now)

    def choose(self, req: RequestView, fleet: FleetView) -> Route:
        slo_ttft = req.slo_ttft_ms or self.ttft_ms
        slo_tpot = req.slo_tpot_ms or self.tpot_ms
        mixed, decode = fleet.by_role(MIXED), fleet.by_role(DECODE)
        if not mixed and not decode:
            return Route(reject=NO_WORKERS)
        self.size_up(req, mixed + decode, fleet.now)
        split = self.pd.split(req, fleet)
        servers = mixed if split else mixed + decode
        candidates: list[tuple[float, float, WorkerView | None, WorkerView]] = [
            (*self.ttft_tpot_ms(req, w), None, w) for w in servers
        ]
        if split:
            candidates += [self.pair(req, c) for c in self.pd.pairs(req, fleet)]
        tier, headroom, ttft, tpot, p, d = self.best(req, candidates, slo_ttft, slo_tpot)
        if self.warmer and not split and self.outgrown(req, candidates, servers, slo_ttft, slo_tpot, fleet.now):
            warm = [self.pair(req, c) for c in self.pd.warm_pairs(req, mixed)]
            if warm:
                tier, headroom, ttft, tpot, p, d = self.best(req, candidates + warm, slo_ttft, slo_tpot)
        if tier == 2:
            return Route(
                reject=f"no {'P/D pair or ' if split else ''}worker meets the SLOs "
                f"(ttft {slo_ttft:.0f} ms, tpot {slo_tpot:.0f} ms): best is "
                f"{_name(p, d)} at ttft {ttft:.0f} ms, tpot {tpot:.1f} ms",
                info={"headroom": headroom},
            )
        return Route(
            worker=d.worker_id,
            prefill=p.worker_id if p else None,
            predicted_cached_tokens=hit_tokens(req, p or d),
            predicted_ttft_ms=ttft,
            predicted_tpot_ms=tpot,
            info={"headroom": headroom},
            reason=f"meets the SLOs: predicted ttft {ttft:.0f} ms, tpot {tpot:.1f} ms, headroom {headroom:.2f}, "
            f"{hit_tokens(req, p or d)} tokens cached" + (f", prefill on {p.worker_id}" if p else ""),
        )

    def best(
        self, req: RequestView, candidates: list[tuple], slo_ttft: float, slo_tpot: float
    ) -> tuple[int, float, float, float, WorkerView | None, WorkerView]:
        """(tier, headroom, ttft, tpot, P, D) of the best of `candidates`, given as
        (ttft, tpot, P, D)."""
        scored = [
            (self.tier(h), h, t, o, p, d) for t, o, p, d in candidates for h in (_headroom(t, o, slo_ttft, slo_tpot),)
        ]
        held = max(cached_tokens(req, w) for c in candidates for w in c[2:] if w is not None)
        scores = [
            (
                k,
                self.sent_share(d, held),
                prefill_work_ms(req, p or d) / slo_ttft + self.pool_terms(req, p, d) - h,
            )
            if k < 2
            else (2, 0.0, -h)
            for k, h, _, _, p, d in scored
        ]
        return cheapest(request_key(req), scored, scores, name=lambda c: _name(c[4], c[5]))

    def sent_share(self, d: WorkerView, held: int) -> float:
        """For a prompt no worker holds: the share of `d`'s pool this router sent new prefixes
        into within its window (0 without one)."""
        if self.routed is None or held or d.total_blocks <= 0:
            return 0.0
        return self.routed.pending_blocks(d.worker_id) / d.total_blocks

    def outgrown(
        self,
        req: RequestView,
        candidates: list[tuple],
        servers: tuple[WorkerView, ...],
        slo_ttft: float,
        slo_tpot: float,
        now: float,
    ) -> bool:
        """Count `req` as demand for the prefix its best holder holds (`self.prefix`, for the
        tally) and say whether that prefix has outgrown its holders (`PrefixWarmer`)."""
        assert self.warmer is not None
        holder, headroom = self.holder(req, candidates, slo_ttft, slo_tpot)
        self.prefix = self.warmer.prefix(req, holder)
        if self.prefix is None:
            return False
        self.warmer.add(self.prefix, now)
        return self.warmer.outgrown(self.prefix, req, holder, headroom, servers)

    def holder(
        self, req: RequestView, candidates: list[tuple], slo_ttft: float, slo_tpot: float
    ) -> tuple[WorkerView, float]:
        """The worker holding the most of the prompt, and its predicted headroom for it: the
        worker another may be warmed from."""
        t, o, _, holder = min(candidates, key=lambda c: (-cached_tokens(req, c[3]), c[3].worker_id))
        return holder, _headroom(t, o, slo_ttft, slo_tpot)

    def size_up(self, req: RequestView, servers: tuple[WorkerView, ...], now: float) -> None:
        """Note what the ledger rules need of `req`: the most of it any server holds, and
        whether it is among the largest lately by pool footprint (the least it can take)."""
        self.now = now
        self.held = max(cached_tokens(req, w) for w in servers)
        footprint = self.footprint = min(uncached_tokens(req, w) for w in servers) + req.max_tokens
        self.big = self.footprints.share_below(footprint) >= 1.0 - self.big_share
        self.footprints.add(footprint)

    def ttft_tpot_ms(self, req: RequestView, w: WorkerView) -> tuple[float, float]:
        """`predict.ttft_tpot_ms`, the TTFT with the wait for a turn in the KV pool: the polled
        estimate, or the ledger's where the class says."""
        ttft, tpot = ttft_tpot_ms(req, w)
        wait = pool_queue_wait_ms(req, w, self.safety)
        if not self.ledger_wait or self.safety > LEDGER_MAX_SAFETY or not (wait > 0 or self.big):
            return ttft + wait, tpot
        ledger = ledger_wait_ms(req, w, self.now)
        if ledger is None:
            return ttft + wait, tpot
        ledger *= self.safety
        slo = req.slo_ttft_ms or self.ttft_ms
        if self.big and ledger > self.big_wait * slo:
            return ttft + slo + ledger, tpot
        if cached_tokens(req, w) >= self.held:
            wait = min(wait, ledger * LEDGER_MARGIN)
        return ttft + wait, tpot

    def pair(self, req: RequestView, c: Pair) -> tuple[float, float, WorkerView | None, WorkerView]:
        """A P/D candidate as (ttft, tpot, P, D). Its TTFT includes D's wait for the KV pool: D
        holds the request to its end, so it waits its turn as a single worker would (warm pairs
        without it copied hot prefixes into full pools). P holds the prompt only while it
        computes it, behind the queue the pair's TTFT counts. A warm pair's P is a mixed worker,
        the prefix's holder, admitting requests in turn: its prefill waits for a turn in that pool
        as any request there would (without it, warm pairs from a holder whose pool was full were
        predicted at ~50 ms and took ~1 s, while a cold copy elsewhere took 21 ms)."""
        head = pool_queue_wait_ms(req, c.prefill, self.safety) if c.prefill.role == MIXED else 0.0
        tail = pool_queue_wait_ms(req, c.decode, self.safety)
        return c.ttft_ms + head + tail, c.tpot_ms, c.prefill, c.decode

    def pool_terms(self, req: RequestView, p: WorkerView | None, d: WorkerView) -> float:
        """What placing the prompt on `d` costs its KV pool, in headroom units (see the class);
        a warm pair (`p` a mixed worker) pays for what the prompt adds to the prefix it copies."""
        if p is not None and p.role == MIXED:
            return pool_share(req, d, uncached_tokens(req, p))
        return pool_share(req, d)

    def tier(self, headroom: float) -> int:
        """0: admissible with headroom >= `margin`; 1: admissible; 2: predicted to miss."""
        if headroom < 0:
            return 2
        return 0 if headroom >= self.margin else 1


def _headroom(ttft: float, tpot: float, slo_ttft: float, slo_tpot: float) -> float:
    """The tighter normalised slack: below 0 means an SLO is missed."""
    return min((slo_ttft - ttft) / slo_ttft, (slo_tpot - tpot) / slo_tpot)


def _name(p: WorkerView | None, d: WorkerView) -> str:
    return f"{p.worker_id}>{d.worker_id}" if p else d.worker_id
