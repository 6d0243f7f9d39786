"""A fleet of simulated workers behind a real routing policy, as a discrete-event simulation.

The router sees what the gateway sees: per worker, the load fields of its last `/state` poll
(every `poll_s`, staggered), the prefix it holds according to a `ResidencyIndex` fed by the
worker's own KV events, and the requests in flight that the router itself counts. Views are
assembled as `gateway.fleet.Fleet.views` does, and the policy's `route` is called as the
gateway calls it. A request reaches its worker `request_overhead_ms` after it arrives (HTTP
and parsing, as `kvgate calibrate` measures them); routing happens on arrival.

Events: arrivals come from the (lazy) workload stream; each worker has at most one pending
step event (the end of its step or decode segment) and a recurring poll, all in one heap
keyed by virtual time. At equal times arrivals go first, so a step starting at t drains
everything that arrived by t.

P/D: with `roles` giving workers the "prefill" and "decode" roles, a policy may route a
request to a pair. As the gateway does, the decode request goes to D at once and D holds it
(as `Engine._admit_pending` does) until its prompt's full blocks are resident or `pd_wait_s`
has passed (then D computes them itself: a fallback); a prefill leg (max_tokens=1, not a
client record) goes to P. P exports its blocks in batches as its prefill steps compute them,
by the engine's own rule (`export_span`, `export_batch_blocks`; 0: all at the end), and each
batch travels over P's link (workers/kv/transfer_time.py: a fixed cost of transfer_latency_s,
then its bytes at transfer_gbps after P's earlier batches; a transport's measured link,
bench/transfer_model.py), overlapping the rest of the prefill. A batch that lands is written
into D's pool by the real `import_payload`, published as stored events like any cached block.
"""

import gc
import heapq
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

from bench.chain_hasher import ChainHasher
from bench.report import tpot_ms
from bench.sim_worker import SimConfig, SimWorker
from bench.workloads import BenchRequest
from gateway.worker_view import with_fields, worker_view
from gateway.index import ResidencyIndex
from policies.api import DEFAULT_TIER_CREDITS, FleetView, Policy, RequestView, TierCredits, WorkerView
from policies.ledger import Ledger, Sent
from workers.kv.cost_model import CostModel
from workers.kv.events import EventBatch, KVEvent
from workers.export_batch import export_span
from workers.kv.hashing import seed_hash
from workers.kv.transfer_time import Link
from workers.pending import PendingKV
from workers.request import Request
from workers.sampling_params import SamplingParams
from workers.transfer import KVPayload, executor_spec, import_payload

STEP, POLL, DELIVER, TRANSFER, KV_TIMEOUT = 0, 1, 2, 3, 4
PREFILL_SUFFIX = "/prefill"


@dataclass
class FleetConfig:
    workers: int = 8
    sim: SimConfig = field(default_factory=SimConfig)
    cost: CostModel = field(default_factory=CostModel)
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 100.0
    poll_s: float = 0.5
    drain_s: float = 120.0
    views_with_cost: bool = False
    request_overhead_ms: float = 0.0
    roles: tuple[str, ...] | None = None  # per worker; None: all mixed
    kv_bytes_per_token: int = 131072  # Llama-3-8B in bf16
    transfer_gbps: float = 20.0  # GB/s (1e9 bytes)
    transfer_latency_s: float = 0.0  # fixed cost per transfer (reserve, commit, handshakes)
    pd_wait_s: float = 5.0  # the gateway's default KV wait on the decode worker
    # the router's credit per tier (gateway --host-kv-credit); sim workers publish their own rates
    tier_credits: TierCredits = DEFAULT_TIER_CREDITS


class FleetSim:
    def __init__(self, policy: Policy, cfg: FleetConfig):
        self.policy = policy
        self.cfg = cfg
        self.seed = seed_hash(cfg.sim.model_id, cfg.sim.block_size)
        self.index = ResidencyIndex()
        self.unindexed: dict[str, list[KVEvent]] = {}  # worker id -> events not yet applied
        self.workers = [self._worker(i) for i in range(cfg.workers)]
        self.position = {w.worker_id: i for i, w in enumerate(self.workers)}
        self.link = Link(cfg.transfer_latency_s, cfg.transfer_gbps)
        self.wire_free = [0.0] * cfg.workers  # per P: when its link has sent the batches queued on it
        self.now = 0.0  # the virtual time of the event being handled
        self.ledgers = [Ledger() for _ in self.workers]  # what the router has in flight, as the gateway's
        self.base = [self._view(w) for w in self.workers]
        self.current = list(self.base)
        self.matched: list[dict[tuple[int, int, int], WorkerView]] = [{} for _ in self.workers]
        self.hasher = ChainHasher(cfg.sim.block_size, self.seed)
        self.in_flight = [0] * cfg.workers
        self.version = [0] * cfg.workers
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.live: dict[str, tuple[Request, int]] = {}
        self.delivering: dict[int, Request] = {}
        self.records: list[dict] = []
        self.events_processed = 0
        self.ended = False  # a request ended in the event being handled (`on_ended`)
        # per D: decode requests waiting for their KV (their timeout is a KV_TIMEOUT event)
        self.held = [PendingKV(w.kv) for w in self.workers]
        # event seq -> (decode request, D, first block, hashes, parent) of a batch in transit
        self.transfers: dict[int, tuple[Request, int, int, list[int], int | None]] = {}
        self.timeouts: dict[int, str] = {}
        self.prefill_of: dict[str, int] = {}  # decode request id -> P
        self.pd_routed = self.pd_arrived = self.pd_fallbacks = 0

    def _worker(self, i: int) -> SimWorker:
        w = SimWorker(
            f"w{i:03d}",
            self.cfg.sim,
            self.cfg.cost,
            lambda req, now: self._finished(req, now, i),
            lambda now: self._admit_held(i, now),
            self._role(i),
            self.cfg.kv_bytes_per_token,
        )
        self.index.reset(w.worker_id, [], 0)
        w.scheduler.exporter = lambda req, final: self._export(req, final, i)
        w.on_first = lambda req, now: self.ledgers[i].start(req.request_id, now)
        w.events.subscribe(lambda events: self.unindexed.setdefault(w.worker_id, []).extend(events))
        return w

    def _index_events(self) -> None:
        """Apply the KV events published since the last routing decision, one batch per
        worker: the index reads the same as when fed event by event, for less work."""
        for wid, events in self.unindexed.items():
            self.index.apply(EventBatch(wid, events, events[-1].seq))
            i = self.position[wid]
            self.base[i] = self._resident(self.base[i])
            self._refresh(i)
        self.unindexed.clear()

    def _role(self, i: int) -> str:
        return self.cfg.roles[i] if self.cfg.roles else "mixed"

    def _view(self, w: SimWorker) -> WorkerView:
        """What a poll of w's /state gives the router, built as the gateway builds it: with the
        bytes still queued on its link, as its `kv_transfer.backlog_bytes` reads."""
        i = self.position[w.worker_id]
        wire_left = max(0.0, self.wire_free[i] - self.now)
        view = worker_view(
            w.state(),
            transfer_gbps=self.cfg.transfer_gbps,
            cost=self.cfg.cost if self.cfg.views_with_cost else None,
            export_backlog_bytes=int(wire_left * self.cfg.transfer_gbps * 1e9),
            tiers=self.cfg.tier_credits,
        )
        return with_fields(view, ledger=self.ledgers[i])

    def _resident(self, view: WorkerView) -> WorkerView:
        """`view` with the blocks the index holds for its worker, as `Fleet.views` adds them."""
        wid = view.worker_id
        return with_fields(view, resident_blocks=self.index.num_blocks(wid), residency_epoch=self.index.epoch(wid))

    def _push(self, t: float, kind: int, i: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, i))

    def _schedule_step(self, i: int, t: float | None) -> None:
        if t is not None:
            self.version[i] = self.seq + 1
            self._push(t, STEP, i)

    # routing

    def route(self, br: BenchRequest) -> None:
        now = br.arrival_s
        cfg = self.cfg
        n = len(br.prompt)
        if n + 1 > cfg.sim.num_blocks * cfg.sim.block_size or n + br.max_tokens > cfg.sim.max_model_len:
            self.failed(now, n, "too_long: the prompt does not fit one worker")
            return
        hashes = self.hasher.hashes(br.prompt)
        self._index_events()
        view = RequestView(
            str(br.index),
            n,
            tuple(hashes),
            br.max_tokens,
            cfg.slo_ttft_ms,
            cfg.slo_tpot_ms,
            br.session,
            model=cfg.sim.model_id,
        )
        matches = self.index.match(hashes)
        route = self.policy.route(view, FleetView(self.views(matches, self.index.slow_blocks(hashes, matches)), now))
        if route.reject:
            self.failed(now, n, f"rejected: {route.reject}")
            return
        i = int(route.worker[1:])
        self.ledgers[i].add(view.request_id, Sent.routed(view, route, cfg.sim.block_size))
        req = Request(
            str(br.index),
            br.prompt,
            SamplingParams(max_tokens=br.max_tokens, ignore_eos=True, seed=br.index),
            arrival=now,
        )
        req.block_hashes = hashes[: (n - 1) // cfg.sim.block_size]
        self.live[req.request_id] = (req, i)
        self.in_flight[i] += 1
        self._refresh(i)
        if route.prefill is not None:
            p = int(route.prefill[1:])
            self.pd_routed += 1
            self.prefill_of[req.request_id] = p
            leg = Request(
                req.request_id + PREFILL_SUFFIX,
                br.prompt,
                SamplingParams(max_tokens=1, ignore_eos=True, seed=br.index),
                arrival=now,
            )
            leg.block_hashes = list(req.block_hashes)  # P's commits extend its own copy
            leg.export = partial(self._send, req, i, p)
            self.live[leg.request_id] = (leg, p)
            self.in_flight[p] += 1
            self._refresh(p)
            self._deliver(leg, p, now)
            self.held[i].hold(req, None)
            self._push(now + cfg.request_overhead_ms / 1000.0 + cfg.pd_wait_s, KV_TIMEOUT, i)
            self.timeouts[self.seq] = req.request_id
            self._admit_if_resident(req, i, now)
            return
        self._deliver(req, i, now)

    def _deliver(self, req: Request, i: int, now: float, at: float | None = None) -> None:
        """Hand `req` to worker i at `at`: by default once the request overhead has passed."""
        at = now + self.cfg.request_overhead_ms / 1000.0 if at is None else at
        if at > now:
            self._push(at, DELIVER, i)
            self.delivering[self.seq] = req
        else:
            self._schedule_step(i, self.workers[i].submit(req, now))

    # P/D

    def _admit_if_resident(self, req: Request, i: int, now: float) -> None:
        """The engine's pending admission for one held request, as its blocks land: admit once
        they are in D's cache, and not before the request itself has reached D."""
        for r, _ in self.held[i].ready(now, lambda r: r is req):
            self.pd_arrived += 1
            self._deliver(r, i, now, max(now, r.arrival + self.cfg.request_overhead_ms / 1000.0))

    def _admit_held(self, d: int, now: float) -> None:
        """The engine's pending admission as D's step starts: admit the held requests (already at
        D) whose blocks are resident now, whoever's import or prefill put them there."""
        held = self.held[d]
        if not len(held):
            return
        overhead = self.cfg.request_overhead_ms / 1000.0
        for req, _ in held.ready(now, lambda r: now >= r.arrival + overhead):
            self.pd_arrived += 1
            self.workers[d].inbox.append(req)

    def _export(self, leg: Request, final: bool, p: int) -> None:
        """P's scheduler after a step of a prefill leg: `Engine._export`'s batches, by its rule."""
        span = export_span(leg, self.cfg.sim.block_size, self.cfg.sim.export_batch_blocks, final)
        if span is not None:
            leg.num_exported = span[1]
            leg.export(leg, *span)

    def _send(self, req: Request, d: int, p: int, leg: Request, start: int, end: int) -> None:
        """Put blocks [start, end) of the leg's prompt on P's link to D, unless D gave up on them."""
        if req.request_id not in self.held[d]:
            return
        B = self.cfg.sim.block_size
        hashes = leg.block_hashes[start:end]
        lands = self.link.lands_s(self.now, self.wire_free[p], len(hashes) * B * self.cfg.kv_bytes_per_token)
        self.wire_free[p] = lands
        self._push(lands, TRANSFER, d)
        self.transfers[self.seq] = (req, d, start, hashes, leg.block_hashes[start - 1] if start else None)

    def _import(self, req: Request, d: int, start: int, hashes: list[int], parent: int | None, now: float) -> None:
        if req.request_id not in self.held[d]:
            return
        w, B = self.workers[d], self.cfg.sim.block_size
        tokens = [req.prompt_ids[k * B : (k + 1) * B] for k in range(start, start + len(hashes))]
        spec = executor_spec(self.cfg.sim.model_id, B, w.executor)
        import_payload(w.pool, w.executor, KVPayload(spec, hashes, tokens, parent, b""))
        w.events.publish()
        self._admit_if_resident(req, d, now)

    def _kv_timeout(self, rid: str, d: int, now: float) -> None:
        req = self.held[d].take(rid)
        if req is not None:
            self.pd_fallbacks += 1
            self._deliver(req, d, now, now)  # D has held it since it arrived, pd_wait_s ago

    def views(self, matches: dict[str, int], slow: dict[str, tuple[int, int]]) -> tuple[WorkerView, ...]:
        """`Fleet.views`: the polled view with this request's match (and how much of it is in
        slower tiers) and the in-flight count. Composed views are cached per worker until its
        poll or in-flight count changes."""
        out = list(self.current)
        for wid, m in matches.items():
            i = self.position[wid]
            host, disk = slow.get(wid, (0, 0))
            key = (m, host, disk)
            v = self.matched[i].get(key)
            if v is None:
                v = self.matched[i][key] = with_fields(
                    self.base[i],
                    matched_blocks=m,
                    in_flight=self.in_flight[i],
                    matched_host_blocks=host,
                    matched_disk_blocks=disk,
                )
            out[i] = v
        return tuple(out)

    def _refresh(self, i: int) -> None:
        """Recompose worker i's view after a poll or an in-flight change."""
        f = self.in_flight[i]
        self.current[i] = with_fields(self.base[i], in_flight=f) if f else self.base[i]
        self.matched[i] = {}

    # results

    def _finished(self, req: Request, now: float, i: int) -> None:
        del self.live[req.request_id]
        self.ended = True
        self.ledgers[i].end(req.request_id)
        self.in_flight[i] -= 1
        self._refresh(i)
        if req.request_id.endswith(PREFILL_SUFFIX):
            return
        p = self.prefill_of.pop(req.request_id, None)
        out = req.num_tokens - req.num_prompt
        error = None if out >= req.params.max_tokens else "evicted: the KV pool cannot hold it"
        ttft = (req.first_token_at - req.arrival) * 1000.0 if req.first_token_at is not None else None
        e2e = (now - req.arrival) * 1000.0
        self.records.append(
            {
                "arrival_s": req.arrival,
                "prompt_tokens": req.num_prompt,
                "output_tokens": out,
                "cached_tokens": max(req.num_cached, 0),
                "ttft_ms": ttft,
                "e2e_ms": e2e,
                "tpot_ms": tpot_ms(ttft, e2e, out) if ttft is not None else None,
                "worker": self.workers[i].worker_id,
                "error": error,
                "prefill_worker": self.workers[p].worker_id if p is not None else None,
            }
        )

    def failed(self, arrival_s: float, n: int, error: str) -> None:
        """Record a request that never ran (refused, too long, unfinished) as an SLO miss."""
        self.records.append(
            {
                "arrival_s": arrival_s,
                "prompt_tokens": n,
                "output_tokens": 0,
                "cached_tokens": 0,
                "ttft_ms": None,
                "tpot_ms": None,
                "e2e_ms": None,
                "worker": None,
                "error": error,
                "prefill_worker": None,
            }
        )

    # the event loop

    def on_ended(self) -> None:
        """A subclass's hook, run after an event in which requests ended (never inside a
        step): a gateway-side queue serves itself here (experiments/pool_oracle.py)."""

    def run(
        self, requests: Iterable[BenchRequest], duration_s: float, progress: Callable[[float, int], None] | None = None
    ) -> list[dict]:
        """Simulate until every request is done or `drain_s` past the last arrival; requests
        still running then are recorded as unfinished (SLO misses).

        The cyclic garbage collector is off meanwhile: a run holds millions of long-lived
        objects (blocks, token tuples, hashes) and makes next to no cyclic garbage, so its
        passes over them would be pure cost."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(requests, duration_s, progress)
        finally:
            if enabled:
                gc.enable()

    def _run(
        self, requests: Iterable[BenchRequest], duration_s: float, progress: Callable[[float, int], None] | None
    ) -> list[dict]:
        for i in range(len(self.workers)):
            self._push(self.cfg.poll_s * i / len(self.workers), POLL, i)
        stream = iter(requests)
        nxt = next(stream, None)
        deadline = duration_s + self.cfg.drain_s
        last_report = time.monotonic()
        while nxt is not None or self.live:
            if nxt is not None and (not self.heap or nxt.arrival_s <= self.heap[0][0]):
                self.route(nxt)
                nxt = next(stream, None)
                continue
            t, seq, kind, i = heapq.heappop(self.heap)
            if t > deadline:
                break
            self.events_processed += 1
            self.now = t
            if kind == POLL:
                self.workers[i].sync(t)
                self.base[i] = self._resident(self._view(self.workers[i]))
                self._refresh(i)
                self._push(t + self.cfg.poll_s, POLL, i)
            elif kind == DELIVER:
                self._schedule_step(i, self.workers[i].submit(self.delivering.pop(seq), t))
            elif kind == TRANSFER:
                self._import(*self.transfers.pop(seq), t)
            elif kind == KV_TIMEOUT:
                self._kv_timeout(self.timeouts.pop(seq), i, t)
            elif seq == self.version[i]:
                self._schedule_step(i, self.workers[i].advance(t))
            if self.ended:
                self.ended = False
                self.on_ended()
            if progress and self.events_processed % 4096 == 0 and time.monotonic() - last_report > 2:
                last_report = time.monotonic()
                progress(t, len(self.records))
        self._index_events()
        for req, _ in list(self.live.values()):
            if req.request_id.endswith(PREFILL_SUFFIX):
                continue
            self.failed(req.arrival, req.num_prompt, "unfinished: still running when the simulation stopped")
        return self.records


def stderr_progress(label: str) -> Callable[[float, int], None]:
    def show(t: float, done: int) -> None:
        print(f"  {label}: virtual {t:8.1f} s, {done} requests done", file=sys.stderr, flush=True)

    return show
