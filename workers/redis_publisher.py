"""Worker -> Redis: KV events onto the pool's stream, the resident set, heartbeats with load.

The engine thread only appends events to a deque; an asyncio task on the server's loop
drains it into one MULTI/EXEC pipeline per batch (stream entry, set update and seq move
together, so a reader of set + seq always sees a consistent snapshot). Redis being down
never blocks the engine: queued events are dropped and, once Redis answers again, the
worker rewrites its whole set from the block pool and says so with a `snapshot` entry.
Heartbeats are registrations signed with the fleet's internal token (redis_schema.Registration):
gateways route only to workers whose registration a token holder signed. A NIXL worker's agent
record (redis_schema.AgentRecord) rides along, with the heartbeat's TTL, for its P/D peers.
"""

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from workers.background import cancel_and_wait
from workers.kv import redis_schema as rs
from workers.kv.events import CLEARED, DEVICE, REMOVED, STORED, EventLog, KVEvent

log = logging.getLogger("kvgate.worker")

MAX_QUEUED = 100_000
SADD_CHUNK = 10_000


class KVSource(Protocol):
    """What a publisher reads of the worker it publishes (an engine, or the bridge's view of a
    server followed from outside): its id, its event log, and a consistent snapshot."""

    worker_id: str
    events: EventLog

    def kv_snapshot(self) -> Future:
        """A future of (resident hashes, the event seq they are current to)."""


class RedisPublisher:
    def __init__(
        self,
        engine: KVSource,
        url: str,
        advertise_url: str,
        pool: str,
        token: str,
        state: Callable[[], dict],
        heartbeat_s: float = 1.0,
        ttl_s: float = 3.0,
        agent: rs.AgentRecord | None = None,
    ):
        """`state`: what a heartbeat carries (the server's /state body: load, KV transport and
        NIXL agent metadata), so peers and gateways find it in Redis. `agent`: this worker's NIXL
        agent, signed here and kept under its own key as long as the heartbeat, which prefill
        workers read by the agent name a reservation names."""
        if not token:
            raise ValueError("publishing to redis needs the fleet's internal token to sign registrations")
        self.engine = engine
        self.state = state
        self.url = url
        self.token = token
        self.advertise_url = advertise_url
        self.pool = pool
        self.worker_id = engine.worker_id
        self.heartbeat_s, self.ttl_ms = heartbeat_s, int(ttl_s * 1000)
        self.agent_key = rs.nixl_key(pool, agent.agent) if agent is not None else None
        self._agent_json = json.dumps(agent.signed(token).to_json()) if agent is not None else ""
        self._queue: deque[KVEvent] = deque()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._published = 0
        self.connected = False
        engine.events.subscribe(self._on_events)

    def _on_events(self, events: list[KVEvent]) -> None:
        """Engine thread, once a step: queue only. Overflow is fine: the seq gap forces a full resync."""
        self._queue.extend(events[: max(0, MAX_QUEUED - len(self._queue))])
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop publishing and deregister, so gateways drop this worker at once."""
        if self._task:
            await cancel_and_wait(self._task)
        try:
            r = self._client()
            async with r.pipeline(transaction=True) as p:
                p.delete(
                    rs.heartbeat_key(self.pool, self.worker_id),
                    *rs.resident_keys(self.pool, self.worker_id),
                    rs.seq_key(self.pool, self.worker_id),
                    *([self.agent_key] if self.agent_key else []),
                )
                p.srem(rs.workers_key(self.pool), self.worker_id)
                await p.execute()
            await r.aclose()
        except (RedisError, OSError) as e:
            log.warning("could not deregister from redis: %r", e)

    def _client(self) -> aioredis.Redis:
        return aioredis.from_url(self.url, socket_timeout=2.0, socket_connect_timeout=1.0)

    async def _run(self) -> None:
        backoff = rs.Backoff()
        while True:
            r = self._client()
            try:
                await self.resync(r)
                self.connected = True
                backoff.reset()
                await self._publish_loop(r)
            except (RedisError, OSError) as e:
                if self.connected:
                    log.warning("redis at %s failed (%r); retrying, then resyncing", rs.redact_url(self.url), e)
                self.connected = False
                self._queue.clear()
                await asyncio.sleep(backoff.next())
            finally:
                await r.aclose()

    async def resync(self, r: aioredis.Redis) -> None:
        """Rewrite every tier's resident set from the block pool, as of the engine's current seq."""
        snap = await asyncio.wrap_future(self.engine.kv_snapshot())
        seq, hashes = snap.seq, snap.hashes
        async with r.pipeline(transaction=True) as p:
            p.delete(*rs.resident_keys(self.pool, self.worker_id))
            for medium, tier in [(DEVICE, hashes), *snap.tiers.items()]:
                res = rs.resident_key(self.pool, self.worker_id, medium)
                for i in range(0, len(tier), SADD_CHUNK):
                    p.sadd(res, *tier[i : i + SADD_CHUNK])
            p.set(rs.seq_key(self.pool, self.worker_id), seq)
            self._xadd(p, [KVEvent(seq, rs.SNAPSHOT)])
            self._heartbeat(p)
            await p.execute()
        self._published = seq
        log.info("published %d resident blocks to redis as of seq %d", len(hashes), seq)

    async def _publish_loop(self, r: aioredis.Redis) -> None:
        next_beat = time.monotonic() + self.heartbeat_s
        while True:
            timeout = max(0.0, next_beat - time.monotonic())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            events = self._drain()
            if events is None:
                await self.resync(r)
                continue
            beat = time.monotonic() >= next_beat
            if not events and not beat:
                continue
            async with r.pipeline(transaction=True) as p:
                if events:
                    self._events(p, events)
                if beat:
                    self._heartbeat(p)
                    next_beat = time.monotonic() + self.heartbeat_s
                await p.execute()
            if events:
                self._published = events[-1].seq

    def _drain(self) -> list[KVEvent] | None:
        """Queued events after the last published seq; None when some were lost (overflow)."""
        out: list[KVEvent] = []
        expect = self._published + 1
        while self._queue:
            ev = self._queue.popleft()
            if ev.seq < expect:
                continue
            if ev.seq != expect:
                self._queue.clear()
                return None
            out.append(ev)
            expect += 1
        return out

    def _events(self, p, events: list[KVEvent]) -> None:
        """Apply the events to the resident sets, move the seq, and add them to the stream as one entry."""
        for ev in events:
            res = rs.resident_key(self.pool, self.worker_id, ev.medium)
            if ev.kind == STORED and ev.hashes:
                p.sadd(res, *ev.hashes)
            elif ev.kind == REMOVED and ev.hashes:
                p.srem(res, *ev.hashes)
            elif ev.kind == CLEARED:
                p.delete(*rs.resident_keys(self.pool, self.worker_id))
        p.set(rs.seq_key(self.pool, self.worker_id), events[-1].seq)
        self._xadd(p, events)

    def _xadd(self, p, events: list[KVEvent]) -> None:
        entry = rs.encode_events(self.worker_id, events)
        p.xadd(rs.stream_key(self.pool), entry, maxlen=rs.STREAM_MAXLEN, approximate=True)

    def _heartbeat(self, p) -> None:
        reg = rs.Registration(self.worker_id, self.advertise_url, self.pool, time.time(), self.state())
        p.set(rs.heartbeat_key(self.pool, self.worker_id), json.dumps(reg.signed(self.token).to_json()), px=self.ttl_ms)
        if self.agent_key:
            p.set(self.agent_key, self._agent_json, px=self.ttl_ms)
        p.sadd(rs.POOLS, self.pool)
        p.sadd(rs.workers_key(self.pool), self.worker_id)
