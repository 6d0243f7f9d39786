"""Continuous batching with chunked prefill under one token budget per step, and what follows
a step: the one lifecycle the engine and the fleet simulator share.

Each step: running requests first (decodes, then unfinished prefills), then waiting requests
in FCFS order, each taking at most what is left of `max_batched_tokens`. When the pool runs
out of blocks a running request is preempted by recompute, newest first, so KV exhaustion
never crashes and never deadlocks. After a step, `update_from_output` commits the blocks it
filled, appends its tokens, checks each for a stop and finishes those that stopped.

A waiting request whose prefix hit runs into the host tier is set aside (`loading`) while its
blocks are copied back: the request waits, nothing else does. Whoever runs the copies marks its
`Load` done (the engine when the executor's copy has completed, the simulator when its virtual
copy time has passed); the next `schedule` lands it (its blocks enter the prefix cache) and
puts the request back at the head of the queue, to be admitted as an ordinary prefix hit.
"""

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from workers.kv_manager import KVCacheManager
from workers.request import FINISHED, RUNNING, WAITING, Request


@dataclass
class StepPlan:
    """What one step computes: (request, number of new tokens) pairs, plus who was preempted."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    evicted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(slots=True)
class Sampled:
    """A token a step sampled for a request, and whether it was its first and its last."""

    req: Request
    token: int
    first: bool
    finish_reason: str | None


def resolve(req: Request, token: int) -> None:
    """Write a sampled token over the request's oldest placeholder (workers/inflight.py), and
    add it to the request's history where a control keeps one."""
    req.token_ids[len(req.token_ids) - req.unresolved] = token
    req.unresolved -= 1
    if req.history is not None:
        req.history.append(token)


def drop_unresolved(req: Request) -> None:
    """Forget placeholders after the request stopped: those steps' tokens are not its output."""
    if req.unresolved:
        del req.token_ids[len(req.token_ids) - req.unresolved :]
        req.unresolved = 0


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int = 1 << 30,
        eos_token_ids: Sequence[int] = (),
    ):
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []  # set aside until their copy back lands, in queue order
        # the P/D exporter, for a request that has one: `exporter(req, final)` after each commit
        # (final=False) and as it stops, before its blocks are freed (final=True)
        self.exporter: Callable[[Request, bool], None] | None = None

    def add(self, req: Request) -> None:
        req.queued_tokens = self.kv.uncached_estimate(req)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or self._copying()

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed: the prefill work queued on this worker. A waiting
        request counts only what its cached prefix did not cover when it was queued, so a queue
        of prefix hits (or of P/D requests whose blocks were imported) reads as the work it is."""
        queued = sum(r.queued_tokens for r in self.waiting) + sum(r.queued_tokens for r in self.loading)
        return queued + sum(r.num_remaining for r in self.running if r.is_prefilling)

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is and free its blocks at once."""
        self.finish(req, "abort")

    def finish(self, req: Request, reason: str) -> None:
        """End a request wherever it is (running, or waiting: preempted while its last token was
        in flight) and free its blocks."""
        if req.status == FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.loading:
            self.loading.remove(req)
        req.status, req.finish_reason = FINISHED, reason
        self.kv.free(req)

    def stop_token(self, req: Request, token: int) -> bool:
        """Whether appending `token` ends `req` as a stop token: one of its stop token ids, or EOS
        unless ignored; none among the first `min_tokens`, where the sampler masks them (an
        executor without logits may still emit one)."""
        p = req.params
        stop = token in p.stop_id_set or (not p.ignore_eos and token in self.eos_token_ids)
        return stop and req.num_output > p.min_tokens

    def check_stop(
        self, req: Request, token: int, stop_string: bool = False, stop_token: bool | None = None
    ) -> str | None:
        """Why `req` stops after appending `token`: "stop" (a stop token, or a stop string, which
        the detokenizer skips among the first `min_tokens` too), "length" (max_tokens, or the
        context is full), or None. `stop_token`: `self.stop_token(req, token)` where the caller
        has it already (it is asked of every token)."""
        p = req.params
        if stop_token is None:
            stop_token = self.stop_token(req, token)
        if stop_token or (stop_string and req.num_output > p.min_tokens):
            return "stop"
        if req.num_output >= p.max_tokens or len(req.token_ids) - req.unresolved >= self.max_model_len:
            return "length"
        return None

    def update_from_output(
        self,
        plan: StepPlan,
        sampled: Sequence[int | None],
        now: float,
        stop_string: Callable[[Request, int, bool], bool] | None = None,
    ) -> list[Sampled]:
        """A launched step's results: per request still live, write its token over the
        placeholder, commit the blocks the step filled, check for a stop and finish it if so.
        `stop_string(req, token, stop_token)` adds the token to the request's text, told whether
        it ends the request as a stop token (`stop_token`: its text is then shown only where the
        request keeps its stop), and says whether the text now ends in a stop string. Requests
        that ended meanwhile (aborted, failed) are skipped."""
        out = []
        for (req, _), token in zip(plan.scheduled, sampled):
            if req.status == FINISHED:
                continue
            if token is not None:
                resolve(req, token)
            self.kv.commit(req)
            if req.export is not None and self.exporter is not None:
                self.exporter(req, False)
            if token is None:
                continue
            first = req.first_token_at is None
            if first:
                req.first_token_at = now
            ends = self.stop_token(req, token)
            hit = stop_string is not None and stop_string(req, token, ends)
            reason = self.check_stop(req, token, hit, ends)
            if reason is not None:
                drop_unresolved(req)
                if req.export is not None and self.exporter is not None:
                    self.exporter(req, True)
                self.finish(req, reason)
            out.append(Sampled(req, token, first, reason))
        return out

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = WAITING
        req.num_preemptions += 1
        req.queued_tokens = self.kv.uncached_estimate(req)
        self.waiting.appendleft(req)
        plan.preempted.append(req)

    def schedule(self) -> StepPlan:
        if self._copying():
            self._land_loads()
        plan = StepPlan()
        budget = self.max_batched_tokens
        decodes, prefills = [], []
        for r in self.running:
            (prefills if r.is_prefilling else decodes).append(r)
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status != RUNNING:  # preempted for a request ahead of it, or finishing
                continue
            n = min(req.num_remaining, budget)
            if not self._make_room(req, n, plan):
                continue
            plan.scheduled.append((req, n))
            budget -= n
        if not plan.preempted:
            budget = self._admit(plan, budget)
        return plan

    def _make_room(self, req: Request, n: int, plan: StepPlan) -> bool:
        """Allocate blocks for req, preempting the newest other running requests if needed."""
        while not self.kv.allocate_slots(req, n):
            victims = [
                r
                for r in self.running
                if r is not req and r.status == RUNNING and all(r is not s for s, _ in plan.scheduled)
            ]
            if not victims:
                if len(self.running) == 1 and not plan.scheduled and not self._copying():
                    self.finish(req, "length")
                    plan.evicted.append(req)
                else:
                    self._preempt(req, plan)
                return False
            self._preempt(victims[-1], plan)
        return True

    def _copying(self) -> bool:
        """Whether copies back hold blocks: a request that finds the pool short then waits for
        them, where it would otherwise be too long for the pool."""
        return bool(self.loading) or self.kv.pool.releasing

    def _land_loads(self) -> None:
        """Requests whose copy back is done return to the head of the queue, in their order, their
        loaded blocks now cached (freed, to be hit at admission: right after this unless the
        step is full); released loads that are done free their blocks."""
        self.kv.pool.land_released()
        done = [r for r in self.loading if r.load is not None and r.load.done]
        for req in done:
            self.kv.land(req)
            self.loading.remove(req)
        self.waiting.extendleft(reversed(done))

    def _admit(self, plan: StepPlan, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.blocks:
                cached = self.kv.match_prefix(req)
                if req.num_cached < 0:
                    req.num_cached = cached
                if req.load is not None:  # its host blocks are on their way back: it waits for them
                    self.loading.append(self.waiting.popleft())
                    continue
            n = min(req.num_remaining, budget)
            if not self.kv.allocate_slots(req, n):
                if not self.running and not plan.scheduled and not self._copying():
                    self.finish(req, "length")
                    plan.evicted.append(req)
                    continue
                self.kv.free(req)
                break
            self.waiting.popleft()
            req.status = RUNNING
            if req.scheduled_at is None:
                req.scheduled_at = time.monotonic()
            self.running.append(req)
            plan.scheduled.append((req, n))
            budget -= n
        return budget
