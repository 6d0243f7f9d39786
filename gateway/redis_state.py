"""Gateway <- Redis: worker discovery, residency (sets + stream), and the load and ledgers shared
between gateway replicas (`gateway.replica_share`), on one connection (layout:
workers/kv/redis_schema.py).

Everything here runs in background tasks that feed the in-memory fleet and index, so a
routing decision never waits on Redis. On start (and after every outage) the replica
bootstraps each registered worker's residency from its set and then tails the pools'
streams. While Redis is down, workers' tailers in the fleet poll `/kv/events` directly
(the embedded path) and in-flight counts are this replica's own.

Only registrations signed with the fleet's internal token join the fleet; others are ignored
and logged. A restarted Redis is empty until the workers re-register, so for `grace_s` after
each (re)connect a worker known before is kept (on the embedded path) rather than dropped.
"""

import asyncio
import logging
import time
import uuid
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.fleet import Fleet
from gateway.index import RESYNC, ResidencyIndex
from gateway.replica_share import INFLIGHT_TABLE, SHARE_LINE, ReplicaShare
from gateway.worker import KVGATE
from workers.kv import redis_schema as rs
from workers.background import cancel_and_wait
from workers.kv.events import MEDIA, EventBatch
from workers.strict_json import peer_object

# Replies as this client gets them (bytes: it does not decode responses); redis-py types them
# as unions of every client's, so they are cast at the call.
Replies = set[bytes]
StreamEntry = tuple[bytes, dict[bytes, bytes]]

log = logging.getLogger("kvgate.gateway")

ERRORS = (RedisError, OSError)
# What this replica reads from Redis and drops when it does not parse (`RedisState.malformed`):
# another replica's shared line or in-flight table, a KV-event stream entry, a worker's
# resident sets and seq.
EVENT_ENTRY, RESIDENT_SET = "event_entry", "resident_set"
MALFORMED = (SHARE_LINE, INFLIGHT_TABLE, EVENT_ENTRY, RESIDENT_SET)


class RedisState:
    def __init__(
        self,
        url: str,
        fleet: Fleet,
        token: str,
        replica_id: str | None = None,
        interval: float = 0.5,
        inflight_interval: float = 0.1,
        grace_s: float = 10.0,
    ):
        if not token:
            raise ValueError("worker discovery in redis needs the fleet's internal token to verify registrations")
        self.url = url
        self.token = token
        self.fleet = fleet
        self.index: ResidencyIndex = fleet.index
        self.interval = interval
        self.registered: dict[str, rs.Registration] = {}  # worker id -> its verified heartbeat
        self.kept: dict[str, rs.Registration] = {}  # known before a reconnect, not re-registered yet
        self.rejected: dict[str, str] = {}  # worker id -> why its registration was ignored at the last read
        self.ignored = 0  # registrations ignored at the last read of the registry
        self.grace_s = grace_s
        self.grace_until = 0.0
        self.cursors: dict[str, bytes] = {}  # pool -> last stream entry id read
        self.up = False
        self.last_bootstrap_s: float | None = None
        self._task: asyncio.Task | None = None
        self.malformed = dict.fromkeys(MALFORMED, 0)  # what was read and dropped, by MALFORMED kind
        self.share = ReplicaShare(fleet, replica_id or uuid.uuid4().hex[:12], inflight_interval, self._malformed)
        self.ledgers = self.share.ledgers

    def status(self) -> str:
        return "up" if self.up else "down"

    def client(self) -> aioredis.Redis:
        return aioredis.from_url(self.url, socket_timeout=2.0, socket_connect_timeout=1.0)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            await cancel_and_wait(self._task)
        self._degrade()

    async def _run(self) -> None:
        backoff = rs.Backoff()
        while True:
            r = self.client()
            try:
                await r.ping()
                self.grace_until = time.monotonic() + self.grace_s
                await self.bootstrap(r)
                self.up = True
                backoff.reset()
                self.share.attach()
                await _first_failure(self._tail(r), self._registry_loop(r), *self.share.loops(r))
            except ERRORS as e:
                if self.up:
                    log.warning("redis at %s failed (%r): routing on the embedded path", rs.redact_url(self.url), e)
            except Exception:
                log.exception("redis state failed: routing on the embedded path")
            finally:
                await r.aclose()
            self._degrade()
            await asyncio.sleep(backoff.next())

    def _degrade(self) -> None:
        """Hand residency back to the workers' direct tailers; forget other replicas' load."""
        self.up = False
        self.share.detach()
        for w in self.fleet.workers.values():
            w.redis_residency = False

    # discovery and residency

    async def bootstrap(self, r: aioredis.Redis) -> int:
        """Read the registry, then every live worker's set + seq and each stream's tail in one
        transaction (a consistent cut); returns the blocks loaded."""
        t0 = time.perf_counter()
        await self.refresh_registry(r)
        pools = sorted({reg.pool for reg in self.registered.values()})
        wids = sorted(self.registered)
        async with r.pipeline(transaction=True) as p:
            for pool in pools:
                p.xrevrange(rs.stream_key(pool), count=1)
            for wid in wids:
                pool = self.registered[wid].pool
                for key in rs.resident_keys(pool, wid):
                    p.smembers(key)
                p.get(rs.seq_key(pool, wid))
            out = await p.execute()
        for pool, tail in zip(pools, out):
            self.cursors[pool] = tail[0][0] if tail else b"0-0"
        total, per = 0, len(MEDIA) + 1
        for i, wid in enumerate(wids):
            replies = out[len(pools) + per * i : len(pools) + per * (i + 1)]
            if replies[-1] is not None:
                self._reset(wid, replies[:-1], replies[-1])
                total += len(replies[0])
        self._claim()
        self.last_bootstrap_s = time.perf_counter() - t0
        log.info(
            "bootstrapped %d resident blocks of %d workers from redis in %.0f ms",
            total,
            len(wids),
            self.last_bootstrap_s * 1000,
        )
        return total

    async def refresh_registry(self, r: aioredis.Redis) -> None:
        """Live workers from their signed heartbeats: new ones join the fleet, expired ones leave,
        except that during the grace after a (re)connect a known worker is kept until it
        re-registers: an empty registry then means a restarted Redis, not a dead fleet (a worker
        that did die meanwhile fails its /state polls and is out of the candidate set anyway)."""
        live = await self._registrations(r)
        known = {**self.kept, **self.registered}
        grace = time.monotonic() < self.grace_until
        self.kept = {wid: reg for wid, reg in known.items() if wid not in live and grace}
        for wid, reg in known.items():
            if wid not in live and wid not in self.kept:
                w = self.fleet.workers.get(reg.url.rstrip("/"))
                if w is not None and not w.static:
                    self.fleet.remove(reg.url)
                self.index.drop(wid)
        for reg in live.values():
            self.fleet.add(reg.url, static=False, kind=str(reg.state.get("kind", KVGATE)))
        self.registered = live

    async def _registrations(self, r: aioredis.Redis) -> dict[str, rs.Registration]:
        """Every heartbeat in the registry that the fleet's token signed, by worker id."""
        pools = sorted(p.decode(errors="replace") for p in cast(Replies, await r.smembers(rs.POOLS)))
        members = [
            (pool, w.decode(errors="replace"))
            for pool in pools
            for w in cast(Replies, await r.smembers(rs.workers_key(pool)))
        ]
        keys = [rs.heartbeat_key(pool, wid) for pool, wid in members]
        beats = cast(list[bytes | None], await r.mget(keys)) if members else []
        live, rejected, ignored = {}, {}, 0
        for (pool, wid), beat in zip(members, beats):
            if beat is None:
                continue
            reg, why = self._verify(pool, wid, beat)
            if reg is not None:
                live[wid] = reg
                continue
            ignored += 1
            if self.rejected.get(wid) != why:
                log.warning("ignoring the registration of worker %r in pool %r: %s", wid, pool, why)
            rejected[wid] = why
        self.rejected, self.ignored = rejected, ignored
        return live

    def _verify(self, pool: str, wid: str, beat: bytes) -> tuple[rs.Registration | None, str]:
        """The registration in `beat` if the fleet's token signed it for this key, else why not.
        It is parsed by `peer_object`: one heartbeat nested past the stack's depth took the
        replica off Redis at every bootstrap."""
        try:
            reg = rs.Registration.from_json(peer_object(beat, "a heartbeat"))
        except ValueError as e:
            return None, f"malformed ({e})"
        why = reg.why_invalid(self.token)
        if why is None and (reg.worker_id, reg.pool) != (wid, pool):
            why = "signed for another worker or pool"
        if why is None and not reg.url.startswith(("http://", "https://")):
            why = "not an http(s) URL"
        return (reg, "") if why is None else (None, why)

    def _claim(self) -> None:
        """Redis now carries the residency of the registered workers the fleet knows."""
        urls = {reg.url.rstrip("/"): wid for wid, reg in self.registered.items()}
        for url, w in self.fleet.workers.items():
            w.redis_residency = url in urls and w.worker_id in (None, urls[url])

    async def resync(self, r: aioredis.Redis, wid: str) -> None:
        pool = self.registered[wid].pool
        async with r.pipeline(transaction=True) as p:
            for key in rs.resident_keys(pool, wid):
                p.smembers(key)
            p.get(rs.seq_key(pool, wid))
            replies = await p.execute()
        w = self.fleet.by_id(wid)
        if replies[-1] is not None and w is not None and w.healthy and w.redis_residency:
            self._reset(wid, replies[:-1], replies[-1])

    def _reset(self, wid: str, sets: list, seq: bytes) -> None:
        """Reset a worker's residency from its tiers' sets (MEDIA order) and seq. Sets that do
        not parse are counted and the worker left unsynced (routed as if it held nothing, resynced
        at the next registry pass), rather than failing the bootstrap of every worker."""
        try:
            tiers = {m: [int(h) for h in members] for m, members in zip(MEDIA[1:], sets[1:]) if members}
            self.index.reset(wid, [int(h) for h in sets[0]], int(seq), tiers)
        except ValueError as e:
            self._malformed(RESIDENT_SET, f"worker {wid!r}: {e}")
            self.index.drop(wid)

    async def _registry_loop(self, r: aioredis.Redis) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.refresh_registry(r)
            await self._add_pools(r)
            self._claim()
            for wid in list(self.registered):
                w = self.fleet.by_id(wid)
                if w is not None and w.healthy and w.redis_residency and self.index.seq(wid) is None:
                    await self.resync(r, wid)

    async def _add_pools(self, r: aioredis.Redis) -> None:
        """Tail pools that appeared since the bootstrap from their current end; their workers'
        sets are read by the resync above, so nothing before the end is needed."""
        for pool in {reg.pool for reg in self.registered.values()} - set(self.cursors):
            tail = cast(list[StreamEntry], await r.xrevrange(rs.stream_key(pool), count=1))
            self.cursors[pool] = tail[0][0] if tail else b"0-0"
            for wid, reg in self.registered.items():
                if reg.pool == pool:
                    self.index.drop(wid)

    async def _tail(self, r: aioredis.Redis) -> None:
        while True:
            if self.cursors:
                await self.read_streams(r)
            else:
                await asyncio.sleep(self.interval)

    async def read_streams(self, r: aioredis.Redis) -> None:
        """Apply what the pools' streams hold past their cursors (waiting up to `interval` for
        it), moving each cursor. A key read back names its pool by the key asked for, not by
        splitting it: a pool's name may hold ':', and its cursor was kept under another name."""
        pools = {rs.stream_key(pool).encode(): pool for pool in self.cursors}
        streams: dict[Any, Any] = {key: self.cursors[pool] for key, pool in pools.items()}
        read = await r.xread(streams, count=1000, block=int(self.interval * 1000))
        for key, entries in cast(list[tuple[bytes, list[StreamEntry]]], read):
            pool = pools[key]
            for entry_id, fields in entries:
                self._apply(fields)
                self.cursors[pool] = entry_id

    def _apply(self, fields: dict) -> None:
        """One stream entry: a flush of one worker's events; a snapshot among them (the worker
        rewrote its sets) or a gap means resync. A malformed entry is counted and skipped."""
        try:
            wid, events = rs.decode_events(fields)
        except ValueError as e:
            self._malformed(EVENT_ENTRY, e)
            return
        w = self.fleet.by_id(wid)
        if w is None or not w.redis_residency or self.index.seq(wid) is None:
            return
        snapshot = any(ev.kind == rs.SNAPSHOT for ev in events)
        if snapshot or self.index.apply(EventBatch(wid, events, events[-1].seq)) == RESYNC:
            self.index.drop(wid)  # the registry loop resyncs it from the set

    def _malformed(self, what: str, why: object) -> None:
        """Count what was read from Redis and dropped; log the first and every 1000th of a
        kind: anything that can write to Redis can write these, and none may stop the gateway."""
        self.malformed[what] += 1
        n = self.malformed[what]
        if n == 1 or n % 1000 == 0:
            log.warning("dropped a malformed %s read from redis (%d so far): %s", what, n, why)


async def _first_failure(*loops) -> None:
    """Run endless loops together until one fails; cancel the rest and raise its error."""
    tasks = [asyncio.ensure_future(c) for c in loops]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            t.result()
    finally:
        await cancel_and_wait(*tasks)
