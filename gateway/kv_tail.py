"""Following a kvgate worker's KV events into the residency index (the embedded path).

One task a worker follows its `/kv/events` stream: one response, a line per batch of events
with the state's fields that changed since the line before, and a heartbeat line each long
poll (`LONG_POLL_S`), so an idle worker's state still arrives that often. Each line is
applied from the connection's `data_received` (gateway.kv_lines on gateway.upstream's pool,
as the proxy reads answers), its state handed to the fleet as a poll's would be. Whenever the
index asks (a gap in the sequence, a new worker id) the tail resyncs from `/kv/snapshot`.
A stream that breaks takes the worker down, as a failed poll does; a worker whose events
Redis carries (gateway.redis_state), or that is down, is not followed. A line or snapshot
that is not one (`EventBatch.from_json`, `KVSnapshot.from_json`) is counted, drops the
worker's residency and resyncs it as a gap does; a line whose state is not one takes the
worker down, as such a poll would.
"""

import asyncio
import logging
from typing import TYPE_CHECKING
from urllib.parse import urlencode

import aiohttp

from gateway.control import refused
from gateway.index import RESYNC
from gateway.kv_lines import Lines, never_full
from gateway.worker import Worker
from workers.kv.events import EventBatch, KVSnapshot

if TYPE_CHECKING:
    from gateway.fleet import Fleet

log = logging.getLogger("kvgate.gateway")

LONG_POLL_S = 5.0  # an idle worker's /kv/events answers (with its state) come this often


class KvTail:
    """The fleet's KV-event tails: `run(w)` is worker `w`'s task."""

    def __init__(self, fleet: "Fleet"):
        self.fleet = fleet
        self.garbled: set[str] = set()  # workers (URLs) whose last line or snapshot was malformed

    async def run(self, w: Worker) -> None:
        """Follow `w`'s stream while it is up and its own; after a failure or a draining
        worker's immediate answer, ask again an interval later."""
        f = self.fleet
        while True:
            if not w.healthy or w.redis_residency or not w.worker_id:
                w.state_rides = False
                await asyncio.sleep(f.interval / 5)
                continue
            epoch, wid = w.epoch, w.worker_id
            try:
                await self.once(w, wid, epoch)
                if w.out is not None:
                    await asyncio.sleep(f.interval)
            except (aiohttp.ClientError, OSError) as e:
                if w.epoch == epoch:
                    f.down(w, f"/kv/events failed: {e!r}")
                await asyncio.sleep(f.interval)
            except ValueError as e:
                self.malformed(w, wid, epoch, e)
                await asyncio.sleep(f.interval)

    def malformed(self, w: Worker, wid: str, epoch: int, e: ValueError) -> None:
        """`w` sent a line or snapshot that is not one: counted (`Worker.malformed_kv`), logged
        once a run of them, and its residency dropped, so the next round resyncs from a
        snapshot as after a gap (retried from the same seq, a bad batch came back for good)."""
        w.malformed_kv += 1
        if w.url not in self.garbled:
            self.garbled.add(w.url)
            log.warning("worker %s at %s sent malformed KV events; resyncing: %s", wid, w.url, e)
        if current(w, wid, epoch):
            self.fleet.index.drop(wid)

    async def once(self, w: Worker, wid: str, epoch: int) -> None:
        """Resync from a snapshot, or follow the worker's stream of event batches (each with its
        state) until it ends, the index needs a resync, or the worker changes. A line is due at
        least every long poll, so a silence past that and `timeout` is a failure."""
        f = self.fleet
        seq = f.index.seq(wid)
        if seq is None:
            snap = KVSnapshot.from_json(await f.get(w.url + "/kv/snapshot", f.timeout + LONG_POLL_S))
            if current(w, wid, epoch) and snap.worker_id == wid:
                f.index.reset(wid, snap.hashes, snap.seq, snap.tiers)
            return
        query = urlencode({"after": seq, "timeout": LONG_POLL_S, "state": 1, "delta": 1, "stream": 1})
        async with asyncio.timeout(f.timeout):
            conn = await f.streams.get(w.url, "/kv/events?" + query, f.headers)
        lines = Lines(lambda body: self.apply_line(w, wid, epoch, body), conn)
        try:
            if conn.status != 200:
                raise refused(w.url) if conn.status == 403 else ConnectionError(f"/kv/events answered {conn.status}")
            await conn.pipe(lines, never_full, f.timeout + LONG_POLL_S)
        except ConnectionError:
            if not lines.ended:
                raise
        finally:
            conn.release()
        if lines.error is not None:
            raise lines.error

    def apply_line(self, w: Worker, wid: str, epoch: int, body: dict) -> bool:
        """Apply one batch of `w`'s events and the state riding on it; False when the stream
        should end (the worker changed, Redis carries it now, or the index needs a resync).
        Raises ValueError for a line that is not a batch, before any of it is applied, or
        whose state is not a state, having taken `w` down as a poll of that state would."""
        index = self.fleet.index
        batch = EventBatch.from_json(body)
        if not current(w, wid, epoch) or w.redis_residency:
            return False
        if batch.worker_id != wid or index.apply(batch) == RESYNC:
            index.drop(wid)
            return False
        state = body.get("state")
        w.state_rides = state is not None
        if state is not None:
            try:
                self.fleet.up(w, state)
            except ValueError as e:
                self.fleet.down(w, f"its /kv/events state: {e}")
                raise
        self.garbled.discard(w.url)
        return True


def current(w: Worker, wid: str, epoch: int) -> bool:
    """Whether an answer fetched as of (`wid`, `epoch`) may still be applied."""
    return w.healthy and w.epoch == epoch and w.worker_id == wid
