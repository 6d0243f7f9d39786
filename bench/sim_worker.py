"""One worker in virtual time: the real scheduler, KV cache manager, block pool and event log,
with each step taking what the `sim` executor's cost model says.

It is the engine's step (drain the inbox, schedule, launch, then `Scheduler.update_from_output`)
cut at the execute: a step starts at one event and its results land at the next, when the
virtual clock reaches its end. Everything but the clock and the fast-forward below is the
engine's own code: the chunks, the step's work and cost, the placeholders of a launched step,
the post-step bookkeeping and the stop check.

Decode segments. When a step can only be "every running request decodes one token" (nothing
waiting, nothing prefilling, the pool has the blocks) the next steps are the same step again
until a request finishes, so k of them run as one event: the k step times are summed from the
same cost model, and blocks, commits and tokens are applied in bulk through the same KV
manager. An arrival routed here mid-segment cuts it after the step in progress, as the
engine would drain it at the next step. The result is identical to stepping one at a time
(tests/test_simulate.py and tests/test_one_lifecycle.py check that), only far fewer events.

The host tier, when on, is the block pool's own (workers/kv/host_pool.py): blocks spill and
load back as on a real worker. Copies back run one after another on a copy engine beside the
steps, each taking its bytes at `host_gbps`: the request that waits for one is set aside by the
scheduler until it is done, as on the engine, and other requests step meanwhile. Copies out
overlap the steps and cost nothing. The disk tier under it, when on, is the pool's too
(workers/kv/disk_pool.py): its reads run one after another on a disk beside the copy engine, each
taking a block's bytes at `disk_gbps`, and a load is done once both its copies and its reads
are. Its writes overlap and cost nothing, as copies out do (on a worker they share the I/O
thread with the reads: this is the simulator's optimism). How much of a slow-tier hit is loaded
rather than recomputed is the worker's own choice (workers/kv/read_back.py, from the same cost
model and rates) unless `load_every_hit`.

Output token ids: a constant per request (from its seed), never in any prompt; what matters
for the cache is only that each request's output blocks hash uniquely.
"""

from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from workers.executors.batch import SeqChunk, step_work
from workers.executors.sim import SimExecutor
from workers.inflight import advance, chunks_of
from workers.kv.block_pool import BlockPool, Load
from workers.kv.cost_model import CostModel, StepWork
from workers.kv.disk_pool import DiskPool, DiskRead
from workers.kv.events import EventLog
from workers.kv.hashing import seed_hash
from workers.kv.host_pool import SWAP_IN, HostPool
from workers.kv.read_back import ReadBack
from workers.kv.worker_state import WorkerState
from workers.kv_manager import KVCacheManager
from workers.request import Request
from workers.scheduler import Scheduler, StepPlan
from workers.step_stats import MEANS_OVER, StepRecord, step_means

OUTPUT_TOKEN_LOW, OUTPUT_TOKEN_SPAN = 1000, 30000


@dataclass
class SimConfig:
    model_id: str = "sim"
    block_size: int = 16
    num_blocks: int = 4096
    max_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 65536
    fast_forward: bool = True
    host_blocks: int = 0  # the host tier (--host-kv-gb's blocks); 0: evicted blocks are dropped
    host_gbps: float = 20.0  # copy-back rate, host -> device (GB/s, 1e9 bytes)
    disk_blocks: int = 0  # the disk tier under the host's (--disk-kv-gb's blocks); 0: none
    disk_gbps: float = 0.5  # read-back rate, block file -> device (GB/s, 1e9 bytes)
    load_every_hit: bool = False  # copy back every slow-tier hit (else: workers/kv/read_back.py's choice)
    export_batch_blocks: int = 16  # P/D export batch mid-prefill (the worker's --kv-export-batch-blocks)


def output_token(chunk: SeqChunk) -> int:
    """The simulated worker's sampled token: a constant per request (from its seed)."""
    return OUTPUT_TOKEN_LOW + (chunk.params.seed or 0) % OUTPUT_TOKEN_SPAN


def sim_executor(cost: CostModel, max_model_len: int) -> SimExecutor:
    """The executor a simulated worker prices its steps with (it never waits: time is virtual)."""
    return SimExecutor(
        cost,
        vocab_size=OUTPUT_TOKEN_LOW + OUTPUT_TOKEN_SPAN,
        max_model_len=max_model_len,
        wait=lambda s: None,
        token=output_token,
    )


class SimWorker:
    """Call `submit` when a request is routed here and `advance` at each time it returns."""

    def __init__(
        self,
        worker_id: str,
        cfg: SimConfig,
        cost: CostModel,
        on_finish: Callable[[Request, float], None],
        on_start: Callable[[float], None] | None = None,
        role: str = "mixed",
        kv_bytes_per_token: int = 0,
    ):
        """`on_start(now)` runs as each step starts, before the inbox is drained: where the
        engine admits held P/D requests whose blocks have arrived (`Engine._admit_pending`)."""
        self.worker_id = worker_id
        self.role = role
        self.kv_bytes_per_token = kv_bytes_per_token
        self.cfg = cfg
        self.events = EventLog(worker_id)
        host = HostPool(cfg.host_blocks, self.events) if cfg.host_blocks > 0 else None
        disk = DiskPool(cfg.disk_blocks, self.events) if host is not None and cfg.disk_blocks > 0 else None
        self.pool = BlockPool(cfg.num_blocks, cfg.block_size, self.events, host, disk)
        read_back = (
            None
            if host is None or cfg.load_every_hit
            else ReadBack(
                cost, cfg.block_size, kv_bytes_per_token, cfg.max_batched_tokens, cfg.host_gbps, cfg.disk_gbps
            )
        )
        self.kv = KVCacheManager(self.pool, seed_hash(cfg.model_id, cfg.block_size), read_back=read_back)
        self.scheduler = Scheduler(self.kv, cfg.max_batched_tokens, cfg.max_num_seqs, cfg.max_model_len)
        self.executor = sim_executor(cost, cfg.max_model_len)
        self.on_finish = on_finish
        self.on_start = on_start
        self.on_first: Callable[[Request, float], None] | None = None  # a request's first token came
        self.inbox: list[Request] = []
        self.busy = False
        self.plan: StepPlan | None = None
        self.sampled: list[int | None] = []
        self.seg_ends: list[float] = []
        self.seg_steps: list[StepRecord] = []
        self.seg_len = 0
        self.seg_done = 0
        self.seg_finishing: list[Request] = []
        self.recent: deque[StepRecord] = deque(maxlen=MEANS_OVER)  # ended steps, as /state reads them
        self.plan_log: StepRecord | None = None  # the step in progress, logged when it ends
        self.before: dict = {}  # the load as the step in progress began
        self.copying: list[tuple[float, list[Load]]] = []  # (when done, loads), in issue order
        self.copy_free_at = 0.0  # when the copy engine has finished what it was handed
        self.disk_free_at = 0.0  # when the disk has finished the jobs it was handed
        self.copy_wait = False  # idle until a copy back is done: an arrival wakes it

    # arrivals and events

    def submit(self, req: Request, now: float) -> float | None:
        """Queue `req`; returns a new time for this worker's next event, if it changed."""
        self.inbox.append(req)
        if not self.busy or self.copy_wait:
            self.busy, self.copy_wait = True, False
            return now
        if self.seg_len:
            cut = 1 + bisect_left(self.seg_ends, now, 0, self.seg_len - 1)
            if cut < self.seg_len:
                self.seg_len = cut
                return self.seg_ends[cut - 1]
        return None

    def advance(self, now: float) -> float | None:
        """Land the step (or segment) ending now, then start the next; None when idle."""
        if self.plan is not None:
            self._land_step(now)
        elif self.seg_len:
            self._land_segment(self.seg_len)
        t = self._start(now)
        self.events.publish()
        return t

    def sync(self, now: float) -> None:
        """Land the segment's steps that have ended by `now` (before a state poll)."""
        if self.seg_len:
            done = bisect_right(self.seg_ends, now, 0, self.seg_len)
            if self.seg_done < done < self.seg_len:
                self._apply_decodes(done - self.seg_done)
                self.events.publish()

    # one step

    def _start(self, now: float) -> float | None:
        self.before = self._load()
        if self.on_start is not None:
            self.on_start(now)
        for req in self.inbox:
            self.scheduler.add(req)
        self.inbox.clear()
        self.seg_len = self.seg_done = 0
        self.copy_wait = False
        while self.scheduler.has_work():
            self._land_copies(now)
            if self.cfg.fast_forward and self._plan_segment(now):
                return self.seg_ends[self.seg_len - 1]
            plan = self.scheduler.schedule()
            self._copy_back(now)
            for req in plan.evicted:
                self.on_finish(req, now)
            if plan.scheduled:
                return self._launch(plan, now)
            if self.copying:
                self.copy_wait = True
                return self.copying[0][0]
        self.busy = False
        return None

    def _launch(self, plan: StepPlan, now: float) -> float:
        """Launch as the engine does: the step's chunks, priced by the executor, their tokens
        counted as computed and placeholders appended for what they sample; the executor's
        tokens are drawn now and written over the placeholders when the step lands."""
        chunks = chunks_of(plan)
        work = step_work(chunks)
        ms = self.executor.cost.work_ms(work)
        self.sampled = [self.executor.token(c) if c.sample else None for c in chunks]
        advance(plan, self.cfg.max_model_len)
        self.plan, self.plan_log = plan, StepRecord(ms, work, ms)
        return now + ms / 1000.0

    def _land_step(self, now: float) -> None:
        """The step has ended: the engine's post-step bookkeeping, then its finished requests."""
        plan, self.plan = self.plan, None
        assert plan is not None and self.plan_log is not None
        self.recent.append(self.plan_log)
        for s in self.scheduler.update_from_output(plan, self.sampled, now):
            if s.first and self.on_first is not None:
                self.on_first(s.req, now)
            if s.finish_reason is not None:
                self.on_finish(s.req, now)

    def _copy_back(self, now: float) -> None:
        """Hand the copies the schedule queued to the copy engine: the copies back, after what it
        is still copying, take their bytes at `host_gbps`; their loads are done when they end."""
        loads = self.pool.take_loads()
        blocks = sum(len(b.block_ids) for b in self.pool.take_copies() if b.direction == SWAP_IN)
        read = self._disk_jobs(now)
        if loads:
            s = blocks * self.cfg.block_size * self.kv_bytes_per_token / (self.cfg.host_gbps * 1e9)
            self.copy_free_at = max(now, self.copy_free_at) + s
            self.copying.append((max(self.copy_free_at, read), loads))

    def _disk_jobs(self, now: float) -> float:
        """Run the disk jobs the schedule queued: each read takes a block's bytes at `disk_gbps`
        after what the disk is still reading; returns when the last one ends (`now` without
        one). Every job's result applies at once: a write's host slot is let go at once."""
        jobs = self.pool.take_disk_jobs()
        reads = sum(isinstance(job, DiskRead) for job in jobs)
        for job in jobs:
            job.ok = True
            self.pool.disk_done(job)
        if not reads:
            return now
        s = reads * self.cfg.block_size * self.kv_bytes_per_token / (self.cfg.disk_gbps * 1e9)
        self.disk_free_at = max(now, self.disk_free_at) + s
        return self.disk_free_at

    def _land_copies(self, now: float) -> None:
        """Mark done the loads whose copies have ended by `now` (the scheduler lands them)."""
        while self.copying and self.copying[0][0] <= now:
            for load in self.copying.pop(0)[1]:
                load.done = True

    # decode segments

    def _steps_left(self) -> int:
        """Decode steps until the first running request finishes (noting which ones finish
        then); 0 if the next step is not a pure decode of every running request."""
        s = self.scheduler
        if s.waiting or s.loading or not s.running or len(s.running) > s.max_batched_tokens:
            return 0
        left, max_len = [], self.cfg.max_model_len
        for r in s.running:
            n, done, prompt = len(r.token_ids), r.num_computed, len(r.prompt_ids)
            if n - done != 1 or done < prompt:
                return 0
            left.append(min(r.params.max_tokens - (n - prompt), max_len - n))
        k = min(left)
        self.seg_finishing = [r for r, n in zip(s.running, left) if n == k]
        return k

    def _blocks_for(self, k: int) -> int:
        B = self.cfg.block_size
        return sum(max(0, -(-(r.num_computed + k) // B) - len(r.blocks)) for r in self.scheduler.running)

    def _plan_segment(self, now: float) -> bool:
        """Plan k identical decode steps (fewer if the pool would run short mid-way)."""
        k = self._steps_left()
        if k and self._blocks_for(k) > self.pool.num_free:
            lo, hi = 0, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self._blocks_for(mid) <= self.pool.num_free else (lo, mid - 1)
            k = lo
        if not k:
            return False
        running = self.scheduler.running
        seqs, kv = len(running), sum(len(r.token_ids) for r in running)
        work_ms = self.executor.cost.work_ms
        works = [StepWork(decode_seqs=seqs, decode_kv_tokens=kv + seqs * i) for i in range(k)]
        self.seg_steps = [StepRecord(ms, w, ms) for w in works for ms in (work_ms(w),)]
        self.seg_ends, t = [], now
        for step in self.seg_steps:
            t += step.ms / 1000.0
            self.seg_ends.append(t)
        self.seg_len, self.seg_done = k, 0
        return True

    def _apply_decodes(self, m: int) -> None:
        """m decode steps for every running request: blocks, then tokens and commits. The
        KV manager is called only where it has something to do (a block to add, a block
        filled); elsewhere its calls are no-ops. A segment only runs requests that have
        sampled already, so each one's last token is its (constant) output token."""
        kv, B = self.kv, self.cfg.block_size
        running = self.scheduler.running
        for r in running:
            if -(-(r.num_computed + m) // B) > len(r.blocks):
                grown = kv.allocate_slots(r, m)
                assert grown, "planned decode segment ran out of blocks"
        for r in running:
            r.num_computed += m
            r.token_ids += [r.token_ids[-1]] * m
            if r.history is not None:
                r.history.extend(r.token_ids[-m:])
            if r.num_computed // B > r.num_registered // B:
                kv.commit(r)
        self.recent.extend(self.seg_steps[self.seg_done : self.seg_done + m])
        self.seg_done += m

    def _land_segment(self, upto: int) -> None:
        if upto > self.seg_done:
            self._apply_decodes(upto - self.seg_done)
        now = self.seg_ends[upto - 1]
        for r in self.seg_finishing:
            reason = self.scheduler.check_stop(r, r.token_ids[-1])
            if reason is not None:
                self.scheduler.finish(r, reason)
                self.on_finish(r, now)

    # what the gateway's state poll would read

    def _load(self) -> dict:
        s = self.scheduler
        return {
            "free_blocks": self.pool.num_free,
            "shared_blocks": self.pool.num_shared,
            "waiting": len(s.waiting) + len(s.loading),
            "running": len(s.running),
            "queued_prefill_tokens": s.queued_prefill_tokens,
            "kv_tokens": sum(r.num_computed for r in s.running),
        }

    def state(self) -> WorkerState:
        """The engine's snapshot: as of the end of the last step that ended. Mid-step that is
        the state before the step was planned (its admissions and blocks not yet shown)."""
        s = self.scheduler
        return WorkerState(
            worker_id=self.worker_id,
            role=self.role,
            model=self.cfg.model_id,
            block_size=self.cfg.block_size,
            total_blocks=self.pool.num_blocks,
            host_blocks=self.cfg.host_blocks,
            host_free_blocks=self.pool.host.num_free if self.pool.host else 0,
            disk_blocks=self.cfg.disk_blocks if self.pool.disk else 0,
            disk_free_blocks=self.pool.disk.num_free if self.pool.disk else 0,
            host_gbps=self.cfg.host_gbps,
            disk_gbps=self.cfg.disk_gbps,
            load_every_hit=self.cfg.load_every_hit,
            **(self.before if self.plan is not None else self._load()),
            max_batched_tokens=s.max_batched_tokens,
            max_num_seqs=s.max_num_seqs,
            **step_means(self.recent),
            kv_bytes_per_token=self.kv_bytes_per_token,
            max_model_len=self.cfg.max_model_len,
            export_batch_blocks=self.cfg.export_batch_blocks,
        )
