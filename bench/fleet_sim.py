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
"""
import heapq
import sys
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from bench.report import tpot_ms
from bench.sim_worker import SimConfig, SimWorker
from bench.workloads import BenchRequest
from gateway.fleet import with_fields
from gateway.index import ResidencyIndex
from policies.api import FleetView, Policy, RequestView, WorkerView
from workers.kv.cost_model import CostModel
from workers.kv.events import EventBatch
from workers.kv.hashing import block_hash, seed_hash
from workers.request import Request
from workers.sampling_params import SamplingParams

STEP, POLL, DELIVER = 0, 1, 2


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


class FleetSim:
    def __init__(self, policy: Policy, cfg: FleetConfig):
        self.policy = policy
        self.cfg = cfg
        self.seed = seed_hash(cfg.sim.model_id, cfg.sim.block_size)
        self.index = ResidencyIndex()
        self.workers = [self._worker(i) for i in range(cfg.workers)]
        self.base = [self._view(w) for w in self.workers]
        self.current = list(self.base)
        self.matched: list[dict[int, WorkerView]] = [{} for _ in self.workers]
        self.position = {w.worker_id: i for i, w in enumerate(self.workers)}
        self.hasher = ChainHasher(cfg.sim.block_size, self.seed)
        self.in_flight = [0] * cfg.workers
        self.version = [0] * cfg.workers
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.live: dict[str, tuple[Request, int]] = {}
        self.delivering: dict[int, Request] = {}
        self.records: list[dict] = []
        self.events_processed = 0

    def _worker(self, i: int) -> SimWorker:
        w = SimWorker(f"w{i:03d}", self.cfg.sim, self.cfg.cost, lambda req, now: self._finished(req, now, i))
        self.index.reset(w.worker_id, [], 0)
        w.events.subscribe(lambda ev: self.index.apply(EventBatch(w.worker_id, [ev], ev.seq)))
        return w

    def _view(self, w: SimWorker) -> WorkerView:
        s = w.state()
        return WorkerView(
            worker_id=s["worker_id"], block_size=s["block_size"], waiting=s["waiting"],
            running=s["running"], free_blocks=s["free_blocks"], total_blocks=s["total_blocks"],
            queued_prefill_tokens=s["queued_prefill_tokens"], kv_tokens=s["kv_tokens"],
            max_batched_tokens=s["max_batched_tokens"], max_num_seqs=s["max_num_seqs"],
            step_ms=s["step_ms"], cost=self.cfg.cost if self.cfg.views_with_cost else None)

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
            self._failed(now, n, "too_long: the prompt does not fit one worker")
            return
        hashes = self.hasher.hashes(br.prompt)
        view = RequestView(str(br.index), n, tuple(hashes), br.max_tokens, cfg.slo_ttft_ms,
                           cfg.slo_tpot_ms, br.session, model=cfg.sim.model_id)
        route = self.policy.route(view, FleetView(self.views(self.index.match(hashes)), now))
        if route.reject:
            self._failed(now, n, f"rejected: {route.reject}")
            return
        i = int(route.worker[1:])
        req = Request(str(br.index), br.prompt, SamplingParams(max_tokens=br.max_tokens, ignore_eos=True,
                                                                 seed=br.index), arrival=now)
        req.block_hashes = hashes[:(n - 1) // cfg.sim.block_size]
        self.live[req.request_id] = (req, i)
        self.in_flight[i] += 1
        self._refresh(i)
        if cfg.request_overhead_ms > 0:
            self._push(now + cfg.request_overhead_ms / 1000.0, DELIVER, i)
            self.delivering[self.seq] = req
        else:
            self._schedule_step(i, self.workers[i].submit(req, now))

    def views(self, matches: dict[str, int]) -> tuple[WorkerView, ...]:
        """`Fleet.views`: the polled view with this request's match and the in-flight count.
        Composed views are cached per worker until its poll or in-flight count changes."""
        out = list(self.current)
        for wid, m in matches.items():
            i = self.position[wid]
            v = self.matched[i].get(m)
            if v is None:
                v = self.matched[i][m] = with_fields(self.base[i], matched_blocks=m, in_flight=self.in_flight[i])
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
        self.in_flight[i] -= 1
        self._refresh(i)
        out = req.num_tokens - req.num_prompt
        error = None if out >= req.params.max_tokens else "evicted: the KV pool cannot hold it"
        ttft = (req.first_token_at - req.arrival) * 1000.0 if req.first_token_at is not None else None
        e2e = (now - req.arrival) * 1000.0
        self.records.append({
            "arrival_s": req.arrival, "prompt_tokens": req.num_prompt, "output_tokens": out,
            "cached_tokens": max(req.num_cached, 0), "ttft_ms": ttft, "e2e_ms": e2e,
            "tpot_ms": tpot_ms(ttft, e2e, out) if ttft is not None else None,
            "worker": self.workers[i].worker_id, "error": error})

    def _failed(self, arrival_s: float, n: int, error: str) -> None:
        self.records.append({"arrival_s": arrival_s, "prompt_tokens": n, "output_tokens": 0,
                             "cached_tokens": 0, "ttft_ms": None, "tpot_ms": None, "e2e_ms": None,
                             "worker": None, "error": error})

    # the event loop

    def run(self, requests: Iterable[BenchRequest], duration_s: float,
            progress: Callable[[float, int], None] | None = None) -> list[dict]:
        """Simulate until every request is done or `drain_s` past the last arrival; requests
        still running then are recorded as unfinished (SLO misses)."""
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
            if kind == POLL:
                self.workers[i].sync(t)
                self.base[i] = self._view(self.workers[i])
                self._refresh(i)
                self._push(t + self.cfg.poll_s, POLL, i)
            elif kind == DELIVER:
                self._schedule_step(i, self.workers[i].submit(self.delivering.pop(seq), t))
            elif seq == self.version[i]:
                self._schedule_step(i, self.workers[i].advance(t))
            if progress and self.events_processed % 4096 == 0 and time.monotonic() - last_report > 2:
                last_report = time.monotonic()
                progress(t, len(self.records))
        for req, i in list(self.live.values()):
            self._failed(req.arrival, req.num_prompt, "unfinished: still running when the simulation stopped")
        return self.records


class ChainHasher:
    """`block_hashes` with a memo of (parent, block tokens) -> hash: requests share long
    prefixes, and a dict lookup is several times cheaper than a blake2b. Same values."""

    def __init__(self, block_size: int, seed: int, limit: int = 1 << 19):
        self.block_size = block_size
        self.seed = seed
        self.limit = limit
        self.memo: dict[tuple, int] = {}

    def hashes(self, tokens: list[int]) -> list[int]:
        B, memo = self.block_size, self.memo
        if len(memo) > self.limit:
            memo.clear()
        raw = array("q", tokens).tobytes()
        out, h, width = [], self.seed, 8 * B
        for i in range(len(tokens) // B):
            key = (h, raw[i * width:(i + 1) * width])
            nh = memo.get(key)
            if nh is None:
                nh = memo[key] = block_hash(h, tokens[i * B:(i + 1) * B])
            out.append(nh)
            h = nh
        return out


def stderr_progress(label: str) -> Callable[[float, int], None]:
    def show(t: float, done: int) -> None:
        print(f"  {label}: virtual {t:8.1f} s, {done} requests done", file=sys.stderr, flush=True)
    return show
