"""Continuous batching with chunked prefill under one token budget per step.

Each step: running requests first (decodes, then unfinished prefills), then waiting requests
in FCFS order, each taking at most what is left of `max_batched_tokens`. When the pool runs
out of blocks a running request is preempted by recompute, newest first, so KV exhaustion
never crashes and never deadlocks.
"""
import time
from collections import deque
from dataclasses import dataclass, field

from workers.kv.kv_manager import KVCacheManager
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


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batched_tokens: int = 2048,
                 max_num_seqs: int = 256):
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        req.queued_tokens = self.kv.uncached_estimate(req)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed: the prefill work queued on this worker. A waiting
        request counts what its cached prefix did not cover when it was queued: counted whole,
        a queue of prefix hits (or of P/D requests whose blocks were just imported) read as
        many times the work it is, and routers predicted this worker far too slow."""
        return sum(r.queued_tokens for r in self.waiting) + sum(
            r.num_remaining for r in self.running if r.is_prefilling)

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is and free its blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.finish(req, "abort")

    def finish(self, req: Request, reason: str) -> None:
        if req.status == FINISHED:
            return
        req.status, req.finish_reason = FINISHED, reason
        self.kv.free(req)

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = WAITING
        req.num_preemptions += 1
        req.queued_tokens = self.kv.uncached_estimate(req)
        self.waiting.appendleft(req)
        plan.preempted.append(req)

    def schedule(self) -> StepPlan:
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
            victims = [r for r in self.running if r is not req and r.status == RUNNING and
                       all(r is not s for s, _ in plan.scheduled)]
            if not victims:
                if len(self.running) == 1 and not plan.scheduled:
                    self.running.remove(req)
                    self.finish(req, "length")
                    plan.evicted.append(req)
                else:
                    self._preempt(req, plan)
                return False
            self._preempt(victims[-1], plan)
        return True

    def _admit(self, plan: StepPlan, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.blocks:
                cached = self.kv.match_prefix(req)
                if req.num_cached < 0:
                    req.num_cached = cached
            n = min(req.num_remaining, budget)
            if not self.kv.allocate_slots(req, n):
                if not self.running and not plan.scheduled:
                    self.waiting.popleft()
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
