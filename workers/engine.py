"""The engine: scheduler + KV manager + executor, stepped by one background thread.

The HTTP server talks to it only through `submit`/`abort` (thread-safe queues) and the
per-request `sink` callbacks it passes in; everything else runs on the engine thread.
Outputs leave once per step, as one batch of (sink, output) pairs handed to `deliver`.
"""
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import islice

from workers.detokenizer import Detokenizer
from workers.executors.batch import Executor, SeqChunk
from workers.kv.block_pool import BlockPool
from workers.kv.cost_model import CostModel
from workers.kv.events import EventLog
from workers.kv.hashing import seed_hash
from workers.kv.kv_manager import KVCacheManager
from workers.request import FINISHED, Request
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, StepPlan

STEP_LOG = 4096  # steps a worker keeps for /steps: minutes of traffic at CPU speed


@dataclass
class EngineConfig:
    model_id: str
    block_size: int = 16
    num_blocks: int = 1024
    max_batched_tokens: int = 2048
    max_num_seqs: int = 256
    worker_id: str = "worker-0"
    role: str = "mixed"
    enable_prefix_caching: bool = True
    cost_model: CostModel | None = None


@dataclass
class RequestOutput:
    """A delta for one request after a step; `finish_reason` is set on the last one."""
    request_id: str
    token_ids: list[int]
    text: str
    num_prompt: int
    num_cached: int
    num_output: int
    finish_reason: str | None = None


@dataclass
class StepStats:
    """What the last steps did and how long they took (for /state, metrics and calibrate).

    `recent` holds (ms, prefill tokens, decode seqs, decode KV tokens, prefill ctx products,
    wall ms) per step, step `steps` last: `ms` is the executor's time, `wall ms` the whole
    step's (scheduling, commits, detokenizing, and any wait for a core or the GIL). /state
    gives the means of the last 32, and GET /steps all it holds (calibration probes read their
    steps there, and `kvgate calibrate --rescale` rescales a profile to them).
    """
    recent: deque = field(default_factory=lambda: deque(maxlen=STEP_LOG))
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    kv_arrived: int = 0
    kv_fallbacks: int = 0
    kv_imported_blocks: int = 0
    kv_exported_blocks: int = 0
    calls_s: float = 0.0  # engine-thread time in `call` functions and exporters: no step ran

    def record(self, ms: float, prefill_tokens: int, decode_seqs: int, kv_tokens: int,
               prefill_ctx_products: float, wall_ms: float) -> None:
        self.steps += 1
        self.recent.append((ms, prefill_tokens, decode_seqs, kv_tokens, prefill_ctx_products, wall_ms))

    def after(self, seq: int) -> list[list[float]]:
        """[step number, *step] for the steps numbered above `seq` that are still held."""
        held = len(self.recent)
        first = self.steps - held + 1
        skip = max(0, seq + 1 - first)
        return [[first + skip + i, *step] for i, step in enumerate(islice(self.recent, skip, None))]


def step_work(plan: StepPlan) -> tuple[int, int, int, float]:
    """(prefill tokens, decode seqs, decode KV tokens, prefill ctx products) of a step about to
    run: the work `CostModel.step_ms` prices. The fleet simulator's workers report the same."""
    prefill = [(r, n) for r, n in plan.scheduled if n > 1 or r.is_prefilling]
    decodes = [r for r, n in plan.scheduled if n == 1 and not r.is_prefilling]
    return (sum(n for _, n in prefill), len(decodes), sum(r.num_tokens for r in decodes),
            sum(n * (r.num_computed + n / 2) for r, n in prefill))


def step_means(recent: list[tuple]) -> dict:
    """Mean time and work per step of `recent` steps, in `CostModel.step_ms` terms: the gateway
    rescales its cost model by the measured time against the model's time for the same work.
    The decode-only steps' means are given apart (`decode_step_*`): prefill and decode differ
    from the model's shape by different factors (on a CPU, ~29x and ~14x the default's), and
    these let the gateway tell them apart. Each step's first five columns are read (the
    engine logs a sixth, the step's wall time, for `kvgate calibrate --rescale`)."""
    if not recent:
        return {"step_ms": None}
    ms, prefill, seqs, kv, ctx = (sum(col) / len(recent) for col in list(zip(*recent))[:5])
    out = {"step_ms": ms, "step_prefill_tokens": prefill, "step_prefill_ctx_products": ctx,
           "step_decode_seqs": seqs, "step_decode_kv_tokens": kv}
    decodes = [r for r in recent if r[1] == 0 and r[2] > 0]
    if decodes:
        ms, _, seqs, kv, _ = (sum(col) / len(decodes) for col in list(zip(*decodes))[:5])
        out.update(decode_step_ms=ms, decode_step_seqs=seqs, decode_step_kv_tokens=kv)
    return out


def call_sinks(batch: list[tuple[Callable, RequestOutput]]) -> None:
    for sink, out in batch:
        sink(out)


class Engine:
    """`deliver(batch)` receives each step's outputs on the engine thread; by default it calls
    each sink there. The server replaces it to hand the whole batch to its event loop in one
    call: one loop wakeup (a self-pipe write) per step, not one per stream."""

    def __init__(self, executor: Executor, tokenizer, config: EngineConfig):
        self.executor = executor
        self.tokenizer = tokenizer
        self.config = config
        self.events = EventLog(config.worker_id)
        self.pool = BlockPool(config.num_blocks, config.block_size, self.events)
        self.kv = KVCacheManager(self.pool, seed_hash(config.model_id, config.block_size),
                                 config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_batched_tokens, config.max_num_seqs)
        self.stats = StepStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._requests: dict[str, tuple[Request, Detokenizer | None, Callable]] = {}
        self._pending: list[Request] = []
        self._outbox: list[tuple[Callable, RequestOutput]] = []
        self.deliver: Callable[[list[tuple[Callable, RequestOutput]]], None] = call_sinks
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._snapshot = self._make_state()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: Callable[[RequestOutput], None], detokenize: bool = True,
               kv_wait_s: float = 0.0, export: Callable | None = None, cache_salt: str | None = None) -> None:
        """Queue a request; `sink` is called from the engine thread with each output delta.

        `kv_wait_s` holds the request back until its prompt's blocks arrive by KV import (P/D
        decode leg), at most that long; then it is admitted and prefills what is missing.
        `export(hashes, tokens, block_ids)` is called on the engine thread when it finishes, while
        its full prompt blocks are still held, so the exporter can read them (P/D prefill leg).
        `cache_salt` seeds the request's block hashes: it shares cached blocks only with requests
        of the same salt.
        """
        self._inbox.put(("add", request_id, prompt_ids, params, sink, detokenize, kv_wait_s, export, cache_salt))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn on the engine thread between steps (snapshots, KV import, cache clears)."""
        fut: Future = Future()
        self._inbox.put(("call", fn, fut))
        self._wake.set()
        return fut

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt_ids, params, sink, detok, kv_wait_s, export, salt = cmd
                req = Request(rid, prompt_ids, params, export=export, cache_salt=salt)
                d = Detokenizer(self.tokenizer, prompt_ids, params.stop) if detok else None
                self._requests[rid] = (req, d, sink)
                if kv_wait_s > 0:
                    req.kv_deadline = time.monotonic() + kv_wait_s
                    self._pending.append(req)
                else:
                    self.scheduler.add(req)
            elif cmd[0] == "abort":
                entry = self._requests.pop(cmd[1], None)
                if entry:
                    req = entry[0]
                    if req in self._pending:
                        self._pending.remove(req)
                    self.scheduler.abort(req)
                    self._outbox.append((entry[2], RequestOutput(
                        req.request_id, [], "", req.num_prompt, max(req.num_cached, 0), len(req.output_ids), "abort")))
            else:
                _, fn, fut = cmd
                t0 = time.perf_counter()
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)
                self.stats.calls_s += time.perf_counter() - t0

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or not self._inbox.empty()

    def _admit_pending(self) -> None:
        """Admit P/D decode requests whose blocks have arrived or whose wait has run out."""
        now, still = time.monotonic(), []
        for req in self._pending:
            if self.kv.prefix_resident(req):
                self.stats.kv_arrived += 1
            elif now >= req.kv_deadline:
                self.stats.kv_fallbacks += 1
            else:
                still.append(req)
                continue
            self.scheduler.add(req)
        self._pending = still

    def step(self) -> list[RequestOutput]:
        """One scheduling step: plan, execute, append tokens, emit deltas."""
        start = time.perf_counter()
        self._drain_inbox()
        if self._pending:
            self._admit_pending()
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        outputs = [self._finish_evicted(r) for r in plan.evicted if r.request_id in self._requests]
        if plan.scheduled:
            work = step_work(plan)
            t0 = time.perf_counter()
            sampled = self.executor.execute(self._chunks(plan))
            ms = (time.perf_counter() - t0) * 1000
            for (req, n), tok in zip(plan.scheduled, sampled):
                req.num_computed += n
                self.kv.commit(req)
                if tok is not None:
                    out = self._append(req, tok)
                    if out is not None:
                        outputs.append(out)
            self.stats.record(ms, *work, (time.perf_counter() - start) * 1000)
        self._snapshot = self._make_state()
        for out in outputs:
            entry = self._requests.get(out.request_id)
            if entry:
                self._outbox.append((entry[2], out))
            if out.finish_reason is not None:
                self._requests.pop(out.request_id, None)
        if self._outbox:
            batch, self._outbox = self._outbox, []
            self.deliver(batch)
        return outputs

    def _chunks(self, plan: StepPlan) -> list[SeqChunk]:
        B = self.config.block_size
        chunks = []
        for req, n in plan.scheduled:
            end = req.num_computed + n
            chunks.append(SeqChunk(
                token_ids=req.token_ids[req.num_computed:end], start_pos=req.num_computed,
                block_table=[b.block_id for b in req.blocks[:-(-end // B)]],
                sample=end == req.num_tokens, params=req.params,
                output_index=req.num_tokens - req.num_prompt))
        return chunks

    def _append(self, req: Request, tok: int) -> RequestOutput | None:
        if req.status == FINISHED:
            return None
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
            self.stats.prompt_tokens += req.num_prompt
            self.stats.cached_tokens += max(req.num_cached, 0)
        req.token_ids.append(tok)
        self.stats.generated_tokens += 1
        p = req.params
        _, detok, _ = self._requests[req.request_id]
        hit_stop = detok.add(tok) if detok and tok not in self.executor.eos_token_ids else False
        reason = None
        if tok in p.stop_token_ids or hit_stop or (not p.ignore_eos and tok in self.executor.eos_token_ids):
            reason = "stop"
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.executor.max_model_len:
            reason = "length"
        if reason:
            self._remove(req, reason)
        text = detok.flush(reason is not None) if detok else ""
        return RequestOutput(req.request_id, [tok], text, req.num_prompt, max(req.num_cached, 0),
                             len(req.output_ids), reason)

    def _remove(self, req: Request, reason: str) -> None:
        if req.export is not None:
            self._export(req)
        if req in self.scheduler.running:
            self.scheduler.running.remove(req)
        self.scheduler.finish(req, reason)
        self.stats.finished += 1

    def _export(self, req: Request) -> None:
        """Hand the request's full prompt blocks to its exporter before they are freed."""
        B = self.config.block_size
        n = min(req.num_prompt // B, req.num_registered // B, len(req.block_hashes))
        if n == 0:
            return
        t0 = time.perf_counter()
        ids = [b.block_id for b in req.blocks[:n]]
        tokens = [req.token_ids[i * B:(i + 1) * B] for i in range(n)]
        req.export(req.block_hashes[:n], tokens, ids)
        self.stats.calls_s += time.perf_counter() - t0

    def _finish_evicted(self, req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, [], "", req.num_prompt, max(req.num_cached, 0),
                             len(req.output_ids), req.finish_reason)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stopped:
            if not (self.scheduler.has_work() or not self._inbox.empty()):
                self._wake.wait(0.002 if self._pending else 0.05)
                self._wake.clear()
            if self.has_work():
                self.step()

    def state(self) -> dict:
        """Load as the gateway's policies need it (GET /state), as of the last step."""
        return self._snapshot

    def _make_state(self) -> dict:
        s, c = self.scheduler, self.config
        log = self.stats.recent
        recent = [log[i] for i in range(-min(32, len(log)), 0)]
        return {
            "worker_id": c.worker_id, "role": c.role, "model": c.model_id,
            "block_size": c.block_size, "total_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.num_free, "waiting": len(s.waiting), "running": len(s.running),
            "queued_prefill_tokens": s.queued_prefill_tokens,
            "kv_tokens": sum(r.num_computed for r in s.running),
            "max_batched_tokens": s.max_batched_tokens, "max_num_seqs": s.max_num_seqs,
            **step_means(recent),
            "cost_model": c.cost_model.to_json() if c.cost_model else None,
            "kv_bytes_per_token": getattr(self.executor, "kv_bytes_per_token", 0),
            "kv_seq": self.events.last_seq,
            "preemptions": self.stats.preemptions,
            "pending_kv": len(self._pending),
            "engine_calls_s": self.stats.calls_s,
            "max_model_len": self.executor.max_model_len,
        }
