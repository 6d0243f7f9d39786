"""In-flight load and ledgers shared between gateway replicas through Redis
(layout: workers/kv/redis_schema.py), run by `gateway.redis_state.RedisState` on its connection.

Each replica publishes every +1/-1 as it decides or finishes (pub/sub, numbered), and writes its
whole table every `inflight_interval` with the number of the last delta it had published.
Another replica's load on a worker is its last table plus the deltas numbered after it: a burst
of decisions at two replicas within one interval is seen within a pub/sub round trip, and the
table (with a TTL) corrects lost messages and replicas that died. Ledger notes
(`gateway.shared_ledger`) ride on the same channel. What another replica wrote and does not
parse is counted through `malformed` and dropped: it must not take this replica off Redis.
"""

import asyncio
import json
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis

from gateway.fleet import Fleet
from gateway.shared_ledger import HELLO, MAX_HELD, LedgerNote, SharedLedgers
from gateway.worker import Worker
from workers.kv import redis_schema as rs

SHARE_LINE, INFLIGHT_TABLE = "share_line", "inflight_table"  # what `malformed` is told was dropped


class ReplicaShare:
    """This replica's side of the load and ledgers shared between replicas."""

    def __init__(self, fleet: Fleet, replica: str, inflight_interval: float, malformed: Callable[[str, object], None]):
        self.fleet, self.replica, self.inflight_interval = fleet, replica, inflight_interval
        self.malformed = malformed
        self.seq = 0  # in-flight deltas this replica has published
        self.outbox: asyncio.Queue[str] | None = None  # lines for SHARE_CHANNEL
        self.ledgers = SharedLedgers(fleet, replica)
        self.tables: dict[str, tuple[int, dict[str, int]]] = {}  # other replica -> (its seq, its counts)
        self.pending: dict[str, dict[int, tuple[str, int]]] = {}  # other replica -> seq -> (worker, delta)
        self.unlisted: set[str] = set()  # replicas whose entries this one held at the last read, not listed

    def attach(self) -> None:
        """Share from now on: the fleet's changes go to the outbox."""
        self.outbox = asyncio.Queue()
        self.fleet.on_change, self.fleet.on_ledger = self.publish, self.publish_note

    def detach(self) -> None:
        """Stop sharing and forget the other replicas' load and ledgers (Redis is gone)."""
        self.fleet.on_change, self.fleet.on_ledger, self.outbox = None, None, None
        self.tables.clear()
        self.pending.clear()
        self.unlisted.clear()
        self.ledgers.clear()
        for w in self.fleet.workers.values():
            w.shared_in_flight = 0

    def loops(self, r: aioredis.Redis) -> list[Coroutine[Any, Any, None]]:
        """The endless loops that share over `r`, to run beside the state's own."""
        return [self.inflight_loop(r), self.send(r), self.receive(r)]

    def publish(self, w: Worker, delta: int) -> None:
        if self.outbox is not None and w.worker_id:
            self.seq += 1
            self.outbox.put_nowait(f"{self.replica} {self.seq} {w.worker_id} {delta}")

    def publish_note(self, note: LedgerNote) -> None:
        """A change to this replica's ledger (`gateway.shared_ledger`), for the others."""
        if self.outbox is not None:
            self.outbox.put_nowait(json.dumps(replace(note, replica=self.replica).to_json()))

    async def send(self, r: aioredis.Redis) -> None:
        """Publish what the outbox holds, its lines packed into as few messages as
        `MAX_SHARE_BYTES` allows: a decision's delta, ledger entry and routing leave as one
        message. Every replica receives every message, at ~0.15 ms of redis-py each, about ten
        times what parsing a line costs."""
        outbox = self.outbox
        assert outbox is not None, "attached before it sends"
        while True:
            lines = [await outbox.get()]
            while not outbox.empty():
                lines.append(outbox.get_nowait())
            async with r.pipeline(transaction=False) as p:
                for msg in packed(lines, rs.MAX_SHARE_BYTES):
                    p.publish(rs.SHARE_CHANNEL, msg)
                await p.execute()

    async def receive(self, r: aioredis.Redis) -> None:
        """Apply the other replicas' deltas and ledger notes; once subscribed, say hello (the
        others answer with their ledgers) and send this replica's own."""
        async with r.pubsub() as ps:
            await ps.subscribe(rs.SHARE_CHANNEL)
            async for msg in ps.listen():
                if msg["type"] == "subscribe":
                    self.publish_note(LedgerNote(self.replica, HELLO))
                    self.publish_note(self.ledgers.snapshot())
                elif msg["type"] == "message":
                    self.message(msg["data"])

    def message(self, data: bytes) -> None:
        """A replica's lines, applied in order (this replica's own are ignored, as `delta` and
        `SharedLedgers.apply` rule); a line that does not parse is counted and dropped."""
        for line in data.split(b"\n"):
            try:
                if line.startswith(b"{"):
                    if self.ledgers.apply(LedgerNote.from_json(json.loads(line))):
                        self.publish_note(self.ledgers.snapshot())
                else:
                    self.delta(line.decode())
            except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                self.malformed(SHARE_LINE, e)

    def delta(self, msg: str) -> None:
        """Apply another replica's delta unless its table already counts it."""
        replica, seq, wid, delta = msg.split()
        if abs(int(delta)) != 1:
            raise ValueError(f"an in-flight delta is +1 or -1, not {delta}")
        if replica == self.replica or int(seq) <= self.tables.get(replica, (0, {}))[0]:
            return
        self.pending.setdefault(replica, {})[int(seq)] = (wid, int(delta))
        w = self.fleet.by_id(wid)
        if w is not None:
            self.fleet.shared(w, int(delta))

    async def inflight_loop(self, r: aioredis.Redis) -> None:
        """Write this replica's table every `inflight_interval`, then read the others'."""
        mine = rs.inflight_key(self.replica)
        ttl_ms = int(max(2.0, 10 * self.inflight_interval) * 1000)
        while True:
            local: dict[Any, Any] = {
                w.worker_id: w.in_flight for w in self.fleet.workers.values() if w.worker_id and w.in_flight
            }
            local[rs.SEQ_FIELD] = self.seq
            async with r.pipeline(transaction=True) as p:
                p.delete(mine)
                p.hset(mine, mapping=local)
                p.pexpire(mine, ttl_ms)
                p.sadd(rs.REPLICAS, self.replica)
                p.smembers(rs.REPLICAS)
                replicas = (await p.execute())[-1]
            names = (x.decode(errors="replace") for x in replicas)
            others = [x for x in names if x != self.replica]
            await self.read_others(r, others)
            await asyncio.sleep(self.inflight_interval)

    async def read_others(self, r: aioredis.Redis, others: list[str]) -> None:
        async with r.pipeline(transaction=False) as p:
            for o in others:
                p.hgetall(rs.inflight_key(o))
            tables = await p.execute() if others else []
        for o, table in zip(others, tables):
            if not table:
                await r.srem(rs.REPLICAS, o)
                self.forget(o)
                continue
            parsed = self.table(table)
            if parsed is None:
                continue  # its last good table stands until it writes one that parses
            self.tables[o] = parsed
            self.pending[o] = {s: d for s, d in self.pending.get(o, {}).items() if s > parsed[0]}
        for gone in (set(self.tables) | set(self.pending)) - set(others):
            self.forget(gone)
        self.forget_unlisted(others)
        self.share()

    def forget_unlisted(self, others: list[str]) -> None:
        """Forget the entries of a replica not listed at two reads in a row: those of one that
        never lists itself (a stray publisher, a fresh name at each note) were held for good.
        A replica lists itself as it starts, before its first note: a second read lists it."""
        strays = set(self.ledgers.held) - set(others)
        for gone in strays & self.unlisted:
            self.forget(gone)
        self.unlisted = strays

    def forget(self, replica: str) -> None:
        """A replica whose table expired (or that left the set) is gone, with its load and entries."""
        self.tables.pop(replica, None)
        self.pending.pop(replica, None)
        self.ledgers.drop(replica)

    def table(self, table: dict) -> tuple[int, dict[str, int]] | None:
        """Another replica's in-flight table as (the seq of its last delta, count per worker), or
        None, counted, where it does not parse or a number is out of range: a seq is >= 0 and a
        count from 0 to `MAX_HELD` (one count made a worker look full here, or hid its load)."""
        try:
            counts = {k.decode(): int(v) for k, v in table.items()}
            seq = counts.pop(rs.SEQ_FIELD, 0)
            if seq < 0 or not all(0 <= n <= MAX_HELD for n in counts.values()):
                raise ValueError(f"a seq is >= 0 and an in-flight count from 0 to {MAX_HELD}")
        except ValueError as e:  # UnicodeDecodeError is a ValueError
            self.malformed(INFLIGHT_TABLE, e)
            return None
        return seq, counts

    def share(self) -> None:
        """Every worker's load at the other replicas: tables plus the deltas after them."""
        shared: dict[str, int] = {}
        for _, counts in self.tables.values():
            for wid, n in counts.items():
                shared[wid] = shared.get(wid, 0) + n
        for deltas in self.pending.values():
            for wid, d in deltas.values():
                shared[wid] = shared.get(wid, 0) + d
        for w in self.fleet.workers.values():
            w.shared_in_flight = max(0, shared.get(w.worker_id, 0))


def packed(lines: list[str], limit: int) -> Iterator[str]:
    """`lines` in order, joined by newlines into messages of at most `limit` characters (a
    longer line goes alone); none of the lines holds a newline (deltas, or JSON as dumped)."""
    group: list[str] = []
    size = 0
    for line in lines:
        if group and size + 1 + len(line) > limit:
            yield "\n".join(group)
            group, size = [], 0
        size += len(line) + (1 if group else 0)
        group.append(line)
    if group:
        yield "\n".join(group)
