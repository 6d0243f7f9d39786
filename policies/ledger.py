"""What one router has in flight at one worker, and when a new request would start there.

A worker's polled load says how full its KV pool is, not when room comes back: that depends
on how far each running request has got, which the router sees in its streams. So the router
keeps, per worker, the requests it sent there (the blocks each holds at its end beyond the
prefix it hit, and when its first token came) and replays the worker's pool first come first
served: running requests end after their remaining decode steps and give back their blocks,
requests sent before this one take theirs in turn. On multi-turn chat, where pools turn over
every few seconds, the polled estimate (`predict.pool_queue_wait_ms`) was twice as long as
the wait the admitted requests met, and refused requests that would have met their SLOs.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.kv.events import MAX_HASH, checked_number
from workers.kv.events import checked_hashes as kv_hashes

if TYPE_CHECKING:  # policies.api holds a Ledger in each WorkerView
    from policies.api import RequestView, Route


MAX_HASHES = 1 << 20  # block hashes in one list crossing between replicas, past any pool
MAX_COUNT = MAX_HASH  # counts crossing between replicas stay far below
MAX_TOKENS = 1 << 24  # decode steps of one ledger entry, past any model's context


def checked_count(x: object, what: str, most: int = MAX_COUNT) -> int:
    """`x` if it is a count from 0 to `most`, else ValueError naming `what`: what crosses
    between gateway replicas (ledger entries, routed prompts) is checked by the KV events' rule
    for numbers (`checked_number`)."""
    return checked_number(x, most, what)


def checked_hashes(x: object, what: str) -> tuple[int, ...]:
    """`x` as block hashes if it is a list of at most `MAX_HASHES` of them (`checked_hashes` of
    the KV events), else ValueError naming `what`: an entry's hit and a routed prompt cross
    between replicas."""
    if not isinstance(x, list) or len(x) > MAX_HASHES:
        raise ValueError(f"{what} is a list of at most {MAX_HASHES} hashes")
    return kv_hashes(x, what)


def checked_time(x: object) -> float | None:
    """`x` as a time (a finite number) or None where it is absent (null), else ValueError: one
    rule for every time that crosses between gateway replicas."""
    if x is None:
        return None
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        raise ValueError(f"a time is a finite number or null, not {x!r}")
    return float(x)


def blocks_held(num_tokens: int, max_tokens: int, cached_tokens: int, block_size: int) -> int:
    """Blocks a request of `num_tokens` prompt tokens holds once it has generated `max_tokens`
    (at least one), beyond the `cached_tokens` it found in blocks of `block_size`."""
    return -(-(num_tokens + max(1, max_tokens)) // block_size) - cached_tokens // block_size


@dataclass(slots=True)
class Sent:
    """One request in flight: `need` blocks held at its end beyond the `hit` blocks (the hash
    of each) it found cached, `max_tokens` decode steps at most, and when its first token came
    (None until then: it waits for room or is prefilling). `max_tokens` is at most `MAX_TOKENS`:
    an entry crosses between replicas, and its steps are multiplied out as floats."""

    need: int
    hit: tuple[int, ...]
    max_tokens: int
    started_at: float | None = None

    @classmethod
    def of(
        cls,
        num_tokens: int,
        max_tokens: int,
        block_hashes: tuple[int, ...],
        cached_tokens: int,
        block_size: int,
        hash_ratio: int = 1,
        started_at: float | None = None,
    ) -> Sent:
        """The entry of a request of `num_tokens` prompt tokens and up to `max_tokens` more, of
        which the worker (blocks of `block_size`) is predicted to hold `cached_tokens`.
        `hash_ratio` of the router's block hashes make one worker block (`gateway.worker.Worker`):
        the last of them, chained, names that block."""
        hit, steps = cached_tokens // block_size, min(MAX_TOKENS, max(1, max_tokens))
        hashes = tuple(block_hashes[hash_ratio - 1 : hit * hash_ratio : hash_ratio])
        return cls(blocks_held(num_tokens, steps, cached_tokens, block_size), hashes, steps, started_at)

    def to_json(self) -> dict:
        return {"need": self.need, "hit": list(self.hit), "max_tokens": self.max_tokens, "started_at": self.started_at}

    @classmethod
    def from_json(cls, d: dict) -> Sent:
        """The entry `to_json` wrote; ValueError for anything else (it crosses between replicas)."""
        hit = checked_hashes(d.get("hit"), "a ledger entry's hit")
        steps = checked_count(d.get("max_tokens"), "a ledger entry's max_tokens", MAX_TOKENS)
        if steps < 1:
            raise ValueError("a ledger entry's max_tokens is at least 1")
        return cls(
            checked_count(d.get("need"), "a ledger entry's need"),
            hit,
            steps,
            checked_time(d.get("started_at")),
        )

    @classmethod
    def routed(
        cls, req: RequestView, route: Route, block_size: int, hash_ratio: int = 1, started_at: float | None = None
    ) -> Sent:
        """The entry of `req` routed by `route` to its worker: a P/D decode worker holds what it
        imports as its own blocks, so only a single worker's predicted hit counts."""
        cached = route.predicted_cached_tokens if route.prefill is None else 0
        return cls.of(req.num_tokens, req.max_tokens, req.block_hashes, cached, block_size, hash_ratio, started_at)


class Ledger:
    """The requests one router has in flight at one worker, in the order it sent them, and the
    blocks of the prefixes they hit (`pinned`: each counted once, however many share it)."""

    def __init__(self) -> None:
        self.sent: dict[str, Sent] = {}
        self.pinned: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self.sent)

    def add(self, request_id: str, entry: Sent) -> None:
        """Count a request just sent (a retry of the same id replaces the earlier entry)."""
        self.end(request_id)
        self.sent[request_id] = entry
        if entry.started_at is not None:
            self.pinned.update(entry.hit)

    def start(self, request_id: str, at: float) -> None:
        """Its first token came at `at`: it runs, and its decode steps are counted from then."""
        entry = self.sent.get(request_id)
        if entry is not None and entry.started_at is None:
            entry.started_at = at
            self.pinned.update(entry.hit)

    def end(self, request_id: str) -> None:
        """It ended (answered, failed or abandoned): its blocks are free again."""
        entry = self.sent.pop(request_id, None)
        if entry is None or entry.started_at is None:
            return
        for h in entry.hit:
            left = self.pinned[h] - 1
            if left > 0:
                self.pinned[h] = left
            else:
                del self.pinned[h]

    def start_s(self, total_blocks: int, need: int, steps: int, step_s: float, now: float) -> float:
        """Seconds from `now` until a request holding `need` blocks for `steps` decode steps of
        `step_s` would start, first come first served behind every request sent before it,
        each holding its whole `need` from its start until its last step. The steps an entry has
        run count up to its `max_tokens`, so no start time, however far back, overflows."""
        free = total_blocks - len(self.pinned)
        ends: list[tuple[float, int]] = []
        queued: list[tuple[int, int]] = []
        for e in self.sent.values():
            if e.started_at is not None and e.started_at <= now:
                done = int(min(e.max_tokens, (now - e.started_at) / step_s)) if step_s > 0 else 0
                free -= e.need
                ends.append((max(1, e.max_tokens - done) * step_s, e.need))
            else:
                queued.append((e.need, e.max_tokens))
        queued.append((need, steps))
        return first_come_start(free, ends, queued, step_s)


def first_come_start(free: int, ends: list[tuple[float, int]], queued: list[tuple[int, int]], step_s: float) -> float:
    """When the last of `queued` ((blocks, decode steps) each, in order) starts in a pool with
    `free` blocks whose running requests give back theirs as `ends` ((seconds from now, blocks)
    each) says: each takes its blocks once enough have come back, after the one before it, and
    holds them for its steps of `step_s`. `ends` is consumed."""
    heapq.heapify(ends)
    t = 0.0
    for n, s in queued:
        while free < n and ends:
            at, blocks = heapq.heappop(ends)
            t, free = max(t, at), free + blocks
        free -= n
        heapq.heappush(ends, (t + s * step_s, n))
    return t
