"""The engine: scheduler + KV manager + executor, stepped by one background thread.

The HTTP server talks to it only through `submit`/`abort` (thread-safe queues) and the
per-request `sink` callbacks it passes in; everything else runs on the engine thread.
Outputs leave once per step, as one batch of (sink, output) pairs handed to `deliver`
(workers/output_processor.py keeps the requests owed an answer and queues their outputs).

A fault never leaves a request unanswered: a step whose executor raises fails that step's
requests (`error="engine_error"`) and the engine goes on; any other exception in the loop fails
every request in flight and the engine goes on; if the thread itself ends, every request in
flight and every later `submit` fails (`engine_stopped`).
"""

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from workers.detokenizer import Detokenizer
from workers.engine_state import engine_state
from workers.executors.batch import Executor, step_work
from workers.export_batch import export_span
from workers.inflight import InFlight, SyncLaunch, advance, chunks_of
from workers.config import EngineConfig
from workers.inbox import Abort, Add, Call, Command
from workers.kv.block_pool import BlockPool
from workers.kv.disk_io import DiskIO
from workers.kv.disk_pool import DiskPool
from workers.kv.events import EventLog, KVSnapshot
from workers.kv.hashing import seed_hash
from workers.kv.read_back import ReadBack
from workers.kv.host_pool import HostPool
from workers.kv.worker_state import WorkerState
from workers.kv_manager import KVCacheManager
from workers.output_processor import OutputProcessor
from workers.outputs import RequestOutput, RequestTimes, call_sinks, ended, unstarted_failure
from workers.pending import PendingKV
from workers.request import FINISHED, Request
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, StepPlan
from workers.step_stats import StepRecord, StepStats
from workers.tier_copies import TierCopies

ENGINE_ERROR = "engine_error"  # the step running the request raised
ENGINE_STOPPED = "engine_stopped"  # the engine thread has ended

log = logging.getLogger("kvgate.engine")


class EngineStopped(RuntimeError):
    """`submit` on an engine whose thread has ended."""


class Engine:
    """`deliver(batch)` receives each step's outputs on the engine thread; by default it calls
    each sink there. The server replaces it to hand the whole batch to its event loop in one
    call: one loop wakeup (a self-pipe write) per step, not one per stream."""

    def __init__(self, executor: Executor, tokenizer, config: EngineConfig):
        self.executor = executor
        self._inflight: InFlight | None = None
        self.tokenizer = tokenizer
        self.config = config
        # The context a request may use is what the model allows and the pool can hold alone.
        self.max_model_len = min(executor.max_model_len, config.num_blocks * config.block_size)
        self.events = EventLog(config.worker_id)
        host = HostPool(config.host_blocks, self.events) if config.host_blocks > 0 else None
        if host is not None:
            executor.allocate_host_cache(config.host_blocks)
        disk = DiskPool(config.disk_blocks, self.events) if host is not None and config.disk_blocks > 0 else None
        self.disk_io = DiskIO(config.disk_dir, config.worker_id, executor) if disk is not None else None
        self.pool = BlockPool(config.num_blocks, config.block_size, self.events, host, disk)
        self.kv = KVCacheManager(
            self.pool, seed_hash(config.model_id, config.block_size), config.enable_prefix_caching, self._read_back()
        )
        self.scheduler = Scheduler(
            self.kv, config.max_batched_tokens, config.max_num_seqs, self.max_model_len, executor.eos_token_ids
        )
        self.scheduler.exporter = self._export
        self.stats = StepStats()
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.output_processor = OutputProcessor(self.stats)
        self._pending = PendingKV(self.kv)
        self.copies = TierCopies(self.pool, self.disk_io, self.stats)
        self.deliver: Callable[[list[tuple[Callable, RequestOutput]]], None] = call_sinks
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._dead = False
        self._submit_lock = threading.Lock()
        self._beat = time.monotonic()
        self._snapshot = engine_state(self, len(self._pending))

    def _read_back(self) -> ReadBack | None:
        """The read-or-recompute choice for slow-tier hits: it needs a host tier and the
        worker's cost model (--sim-profile, or the sim executor's); without one, or with
        `load_every_hit`, every hit is copied back."""
        c = self.config
        if self.pool.host is None or c.cost_model is None or c.load_every_hit:
            return None
        kv_bytes = getattr(self.executor, "kv_bytes_per_token", 0)
        return ReadBack(c.cost_model, c.block_size, kv_bytes, c.max_batched_tokens, c.host_gbps, c.disk_gbps)

    @property
    def executor(self) -> Executor:
        return self._executor

    @executor.setter
    def executor(self, executor: Executor) -> None:
        """Steps go through launch/collect; an executor that overlaps lets the next step be
        planned while the device runs this one (workers/inflight.py)."""
        self._executor = executor
        self._launcher = executor if hasattr(executor, "launch") else SyncLaunch(executor)
        self._overlap = bool(getattr(self._launcher, "overlaps", False))

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[RequestOutput], None],
        detokenize: bool = True,
        kv_wait_s: float = 0.0,
        export: Callable | None = None,
        cache_salt: str | None = None,
        trace: bool = False,
    ) -> None:
        """Queue a request; `sink` is called from the engine thread with each output delta.

        `kv_wait_s` holds the request back until its prompt's blocks arrive by KV import (P/D
        decode leg), at most that long; then it is admitted and prefills what is missing.
        `export(hashes, tokens, block_ids, parent)` is called on the engine thread with its full
        prompt blocks as each prefill step computes them, while they are held, so the exporter
        ships a long prompt's early blocks while later ones compute (P/D prefill leg).
        `cache_salt` seeds the request's block hashes: it shares cached blocks only with requests
        of the same salt. `trace` keeps the times of its prefill chunks (for its spans). Raises
        EngineStopped once the engine thread has ended: nothing would ever answer.
        """
        with self._submit_lock:
            if self._dead:
                raise EngineStopped("the engine has stopped")
            self._inbox.put(Add(request_id, prompt_ids, params, sink, detokenize, kv_wait_s, export, cache_salt, trace))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))
        self._wake.set()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn on the engine thread between steps (snapshots, KV import, cache clears)."""
        fut: Future = Future()
        self._inbox.put(Call(fn, fut))
        self._wake.set()
        return fut

    def _take_inbox(self) -> Iterator[Command]:
        """The queued commands, oldest first, until the inbox is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for cmd in self._take_inbox():
            if isinstance(cmd, Add):
                self._add(cmd)
            elif isinstance(cmd, Abort):
                self._abort(cmd.request_id)
            else:
                t0 = time.perf_counter()
                try:
                    cmd.future.set_result(cmd.fn())
                except Exception as e:
                    cmd.future.set_exception(e)
                self.copies.start(self.executor)  # a KV import may write its blocks off this thread next
                self.stats.calls_s += time.perf_counter() - t0

    def _abort(self, rid: str) -> None:
        state = self.output_processor.pop(rid)
        if state:
            self._drop(state.req)
            self.output_processor.send(state.sink, ended(state.req, "abort", timed=True))

    def _add(self, cmd: Add) -> None:
        rid = cmd.request_id
        try:
            req = Request(
                rid,
                cmd.prompt_ids,
                cmd.params,
                export=cmd.export,
                cache_salt=cmd.cache_salt,
                chunks=[] if cmd.trace else None,
            )
            d = Detokenizer(self.tokenizer, cmd.prompt_ids, cmd.params) if cmd.detokenize else None
        except Exception:
            log.exception("request %s could not be set up", rid)
            self.stats.failed += 1
            self.output_processor.send(cmd.sink, unstarted_failure(rid, cmd.prompt_ids, ENGINE_ERROR))
            return
        self.output_processor.add_request(req, d, cmd.sink)
        if cmd.kv_wait_s > 0:
            self._pending.hold(req, time.monotonic() + cmd.kv_wait_s)
        else:
            self.scheduler.add(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or not self._inbox.empty() or self._inflight is not None

    def _admit_pending(self) -> None:
        """Admit P/D decode requests whose blocks have arrived or whose wait has run out."""
        for req, arrived in self._pending.ready(time.monotonic()):
            if arrived:
                self.stats.kv_arrived += 1
            else:
                self.stats.kv_fallbacks += 1
            self.scheduler.add(req)

    def step(self) -> list[RequestOutput]:
        """One scheduling step: plan and launch a step, then resolve the previous one (with an
        overlapping executor) or this one: append tokens, stop, emit deltas."""
        start = time.perf_counter()
        self._drain_inbox()
        if self._pending:
            self._admit_pending()
        if self.copies.busy:
            self.copies.poll(self.executor)
        plan = self.scheduler.schedule()
        self.copies.start(self.executor)
        if not plan.scheduled and self._inflight is None and self.copies.copying:
            self.copies.poll(self.executor, wait=True)  # nothing runs until a copy back lands: wait, do not spin
        self.stats.preemptions += len(plan.preempted)
        live = self.output_processor.request_states
        outputs = [ended(r, r.finish_reason) for r in plan.evicted if r.request_id in live]
        launched = self._launch(plan, start, outputs) if plan.scheduled else None
        if self._overlap:
            launched, self._inflight = self._inflight, launched
        if launched is not None:
            outputs += self._resolve(launched)
        self._snapshot = engine_state(self, len(self._pending))
        self.events.publish()
        self.output_processor.process_outputs(outputs)
        batch = self.output_processor.take()
        if batch:
            self.deliver(batch)
        return outputs

    def _launch(self, plan: StepPlan, start: float, outputs: list[RequestOutput]) -> InFlight | None:
        """Hand the plan to the executor and count its tokens as launched; if the executor raises,
        the plan's requests fail (into `outputs`) and nothing of the step is kept."""
        chunks = chunks_of(plan)
        work = step_work(chunks)
        t0 = time.perf_counter()
        try:
            handle = self._launcher.launch(chunks)
        except Exception:
            log.exception("a step of %d requests raised; failing them", len(plan.scheduled))
            outputs += [self._fail(req, ENGINE_ERROR) for req, _ in plan.scheduled]
            return None
        advance(plan, self.max_model_len)
        return InFlight(plan, handle, work, start, t0)

    def _resolve(self, step: InFlight) -> list[RequestOutput]:
        """Read a launched step's tokens, commit its blocks, append and stop; requests that
        ended meanwhile (aborted, failed, stopped one step earlier) are skipped."""
        try:
            sampled, ms = self._launcher.collect(step.handle)
        except Exception:
            log.exception("a step of %d requests failed on the device; failing them", len(step.plan.scheduled))
            return [self._fail(req, ENGINE_ERROR) for req, _ in step.plan.scheduled if req.status != FINISHED]
        now = time.monotonic()
        launched = now - (time.perf_counter() - step.launched)
        for req, n in step.plan.scheduled:
            if req.chunks is not None and req.first_token_at is None and req.status != FINISHED:
                req.chunks.append((launched, now, n))
        processor = self.output_processor
        done = self.scheduler.update_from_output(step.plan, sampled, now, processor.hit_stop_string)
        self.stats.record(StepRecord(ms, step.work, (time.perf_counter() - step.start) * 1000))
        logprobs = getattr(step.handle, "logprobs", None) or ()
        by_request = {id(req): lp for (req, _), lp in zip(step.plan.scheduled, logprobs) if lp is not None}
        return [processor.make_output(s, by_request.get(id(s.req))) for s in done]

    def _drop(self, req: Request) -> None:
        """Take a request out of the pending list or the scheduler and free its blocks."""
        self._pending.take(req.request_id)
        self.scheduler.abort(req)

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """Take a request out wherever it is, free its blocks, and say why it failed. Its blocks
        were never committed for the failed step, so nothing it half-computed enters the cache."""
        self._drop(req)
        self.stats.failed += 1
        return ended(req, "error", why)

    def _fail_all(self, why: str) -> None:
        """Fail every request in flight and hand out what is owed (after a fault outside the
        executor, when the engine's state can no longer be trusted for them)."""
        processor = self.output_processor
        for rid, state in list(processor.request_states.items()):
            try:
                out = self._fail(state.req, why)
            except Exception:
                log.exception("request %s could not be released", rid)
                out = ended(state.req, "error", why)
            out.times = RequestTimes.of(state.req)
            processor.send(state.sink, out)
        processor.request_states.clear()
        self._pending.clear()
        self._inflight = None
        self._flush()

    def _flush(self) -> None:
        batch = self.output_processor.take()
        if batch:
            try:
                self.deliver(batch)
            except Exception:
                log.exception("could not deliver %d outputs", len(batch))

    def _export(self, req: Request, final: bool) -> None:
        """Hand the request's full prompt blocks not handed yet to its exporter, in the batches
        `export_span` makes of them (block-batch pipelining: their transfer overlaps the prefill
        of later blocks)."""
        B = self.config.block_size
        span = export_span(req, B, self.config.export_batch_blocks, final)
        if span is None:
            return
        start, n = span
        t0 = time.perf_counter()
        ids = [b.block_id for b in req.blocks[start:n]]
        tokens = [req.token_ids[i * B : (i + 1) * B] for i in range(start, n)]
        req.num_exported = n
        try:
            req.export(req.block_hashes[start:n], tokens, ids, req.block_hashes[start - 1] if start else None)
        except Exception:  # the decode side recomputes what it does not get
            log.exception("KV export of request %s failed", req.request_id)
        self.stats.calls_s += time.perf_counter() - t0

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

    def stall_s(self) -> float:
        """Seconds since the loop last went round while it has work (0.0 when idle): a step
        that never returns (a hung device, a deadlock) shows here, and in /health."""
        if not self.has_work():
            return 0.0
        return max(0.0, time.monotonic() - self._beat)

    def _loop(self) -> None:
        try:
            while not self._stopped:
                if not (self.scheduler.has_work() or not self._inbox.empty() or self._inflight is not None):
                    self._wake.wait(0.002 if self._pending else 0.05)
                    self._wake.clear()
                if self.has_work():
                    try:
                        self.step()
                    except Exception:
                        log.exception("engine step failed outside the executor; failing every request in flight")
                        self._fail_all(ENGINE_ERROR)
                self._beat = time.monotonic()
        finally:
            self._close()

    def _close(self) -> None:
        """The thread is ending: refuse new requests and answer every one still owed."""
        with self._submit_lock:
            self._dead = True
        if not self._stopped:
            log.critical("the engine thread has stopped; every request now fails")
        self._fail_all(ENGINE_STOPPED)
        self.copies.close()
        for cmd in self._take_inbox():
            if isinstance(cmd, Add):
                self.output_processor.send(cmd.sink, unstarted_failure(cmd.request_id, cmd.prompt_ids, ENGINE_STOPPED))
            elif isinstance(cmd, Call):
                cmd.future.set_exception(EngineStopped("the engine has stopped"))
        self._flush()

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    def kv_snapshot(self) -> Future:
        """A future of the KVSnapshot of every tier, read between steps."""
        return self.call(
            lambda: KVSnapshot(
                self.worker_id, self.events.last_seq, self.pool.resident_hashes(), self.pool.tier_hashes()
            )
        )

    @property
    def computes_logprobs(self) -> bool:
        """Whether the executor has a token distribution to report logprobs from."""
        return bool(getattr(self.executor, "computes_logprobs", False))

    def step_log(self, after: int) -> Future:
        """A future of (the last step's number, the logged steps after `after` as GET /steps
        gives them), read between steps."""
        return self.call(lambda: (self.stats.steps, self.stats.after(after)))

    def clear_cache(self) -> Future:
        """A future of the number of cached blocks evicted from the prefix cache."""
        return self.call(self.pool.clear_cache)

    def state(self) -> WorkerState:
        """Load as the gateway's policies need it (GET /state: workers/engine_state.py), as of the last step."""
        return self._snapshot
