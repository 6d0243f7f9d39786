"""One engine's ZMQ event stream kept in step with a residency sink.

A SUB socket receives the live batches; a DEALER asks the publisher's replay ROUTER for the
batches it still holds (vLLM keeps the last 10,000). Sync: the sink is reset, whatever waited
in the SUB queue is dropped, and everything from seq 0 is replayed; then live batches apply in
seq order. A batch past the next expected seq is a gap: the missing ones are replayed, and if
the publisher no longer holds them the whole sync runs again. A batch below it is a duplicate
(the replay already applied it) unless it is newer than the last applied one, which means the
publisher restarted (its numbering went back to 0): sync again. There is no snapshot: blocks
cached before the oldest batch the publisher still holds stay unknown until they are stored
again, which under-states residency (a missed hit), never over-states it.

A malformed event is left out of its batch (vllm_batch, vllm_events) but for a clear or the removals it
names, and counted in `bad_events`; the batch's other events apply in order, and so do those of
a batch whose ts or dp_rank is malformed (counted there too; such a ts tells no restart). A
batch whose payload is no batch at all is stepped over in its place, as if it held no events,
and counted in `bad_batches`: the publisher keeps the same bytes in its replay buffer, so a
resync would meet them again, forever. Either way the events lost cost residency: blocks they
removed stay resident here (an over-statement) until stored and removed again or the cache is
cleared. A message without a readable seq (a wrong frame count, a seq frame not 8 bytes) is
dropped live, where nothing tells its place. A replay sends its batches in seq order, so there
it is stepped over as the batch after the previous one (the first: the seq the replay was asked
from); the first of a replay from 0 has no known place and is only counted, the next message
setting the order. Failing the replay instead would resync, meet the same bytes in the
publisher's buffer, and resync forever.

Everything runs in one asyncio task on the caller's loop; routing reads only the sink.
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio

from gateway.vllm_batch import BadBatch, EngineBatch, decode_frames, decode_replay
from gateway.vllm_translate import Change, Translator

log = logging.getLogger("kvgate.gateway")

REPLAY_TIMEOUT_S = 5.0
RCVHWM = 1_000_000


class Sink(Protocol):
    def reset(self) -> None:
        """The engine's residency is unknown: start again from nothing."""

    def apply(self, changes: list[Change]) -> bool:
        """Residency transitions, in order; False when the sink lost its state (sync again)."""


class Resync(Exception):
    """Start the sync again."""


@dataclass(frozen=True)
class Dropped:
    """Batch `seq`, whose payload or, in a replay, seq did not decode (`why`): it keeps its place
    in the order, with no events, since asking the publisher for it again would bring the same
    bytes."""

    seq: int
    why: str


Received = EngineBatch | Dropped


@dataclass
class SubscriberStats:
    batches: int = 0
    duplicates: int = 0
    bad_batches: int = 0  # stepped over in order (no decode), or dropped (no readable seq, no place)
    bad_events: int = 0  # malformed events (only a clear or removal of each applied), ts and dp_rank fields
    gaps: int = 0
    syncs: int = 0
    restarts: int = 0
    replayed: int = 0
    history_from: int | None = None  # the first seq the last sync replayed (0: complete)
    lag_s: list[float] = field(default_factory=list)  # receive time - publish time, recent live batches


class Subscriber:
    def __init__(
        self,
        address: str,
        bind: bool,
        replay: str | None,
        topic: str,
        translator: Translator,
        sink: Sink,
        name: str,
        ctx: zmq.asyncio.Context | None = None,
        stats: SubscriberStats | None = None,
    ):
        self.address, self.bind, self.replay_address, self.topic = address, bind, replay, topic
        self.translator, self.sink, self.name = translator, sink, name
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.stats = stats or SubscriberStats()
        self.expected: int | None = None
        self.last_ts = 0.0
        self.batches_with_bad_events = 0
        self.synced = asyncio.Event()

    async def run(self) -> None:
        """Follow the stream until cancelled."""
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            sub.bind(self.address) if self.bind else sub.connect(self.address)
            backoff = 0.1
            while True:
                try:
                    await self.sync(sub)
                    backoff = 0.1
                    await self.follow(sub)
                except Resync as e:
                    log.info("kv events of %s: resync (%s)", self.name, e)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 2.0)
        finally:
            sub.close(linger=0)

    async def sync(self, sub: zmq.asyncio.Socket) -> None:
        self.stats.syncs += 1
        self.synced.clear()
        self.translator.reset()
        self.sink.reset()
        while await sub.poll(0):
            await sub.recv_multipart()
        self.expected, self.last_ts = None, 0.0
        if self.replay_address is not None:
            first = await self.replay(0)
            self.stats.history_from = first
            if first is None:
                self.expected = 0  # nothing published yet: the first batch to come is seq 0
            elif first:
                log.warning(
                    "kv events of %s: the publisher holds batches from seq %d on; blocks cached "
                    "before them are unknown until stored again",
                    self.name,
                    first,
                )
        self.synced.set()

    async def follow(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            try:
                batch: Received = decode_frames(await sub.recv_multipart())
            except BadBatch as e:
                if e.seq is None:
                    self.bad(str(e))
                    continue
                batch = Dropped(e.seq, str(e))
            try:
                self.receive(batch)
            except Gap:
                if self.replay_address is None or self.expected is None:
                    raise Resync(f"gap before seq {batch.seq} and no replay endpoint") from None
                await self.replay(self.expected)
                self.receive(batch)

    def receive(self, batch: Received) -> None:
        """Apply a live batch, or raise Resync; a gap is filled by a replay first."""
        if self.expected is None or batch.seq == self.expected:
            self.apply(batch)
            if isinstance(batch, EngineBatch) and batch.ts is not None:
                lag = self.stats.lag_s
                lag.append(time.time() - batch.ts)
                if len(lag) > 1024:
                    del lag[:512]
        elif batch.seq < self.expected:
            # A dropped batch, or one whose ts did not read, cannot tell a restart from a duplicate.
            if isinstance(batch, EngineBatch) and batch.ts is not None and batch.ts > self.last_ts:
                self.stats.restarts += 1
                raise Resync(f"seq went back from {self.expected - 1} to {batch.seq}: the engine restarted")
            self.stats.duplicates += 1
        else:
            self.stats.gaps += 1
            raise Gap(batch)

    async def replay(self, start: int) -> int | None:
        """Apply the publisher's batches from `start` on; returns the first seq it held (None:
        it held none). Raises Resync when it cannot answer or no longer holds `start`."""
        if self.replay_address is None:
            raise Resync("no replay endpoint")
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        first = None
        place = start or None  # the seq of the next message, should its own not read
        try:
            dealer.connect(self.replay_address)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                batch = await self.replayed(dealer, place)
                if batch is None:
                    return first
                place = batch.seq + 1
                if first is None:
                    first = batch.seq
                    if start and batch.seq != start:
                        raise Resync(f"replay asked from seq {start} starts at {batch.seq}: batches lost")
                if self.expected is None or batch.seq >= self.expected:
                    self.stats.replayed += 1
                    self.apply(batch)
                    await asyncio.sleep(0)
        finally:
            dealer.close(linger=0)

    async def replayed(self, dealer: zmq.asyncio.Socket, place: int | None) -> Received | None:
        """The replay's next batch (None: the end marker). One without a readable seq is Dropped
        at `place`, since the publisher replays in seq order; with no place known (the first
        of a replay from 0) it is counted as bad and the next message read."""
        while True:
            if not await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                raise Resync(f"no replay from {self.replay_address} within {REPLAY_TIMEOUT_S:.0f} s")
            try:
                return decode_replay(await dealer.recv_multipart())
            except BadBatch as e:
                seq = place if e.seq is None else e.seq
                if seq is not None:
                    return Dropped(seq, str(e))
                self.bad(f"{e} (first of a replay from seq 0: no place in the order)")

    def apply(self, batch: Received) -> None:
        """Apply the next batch in order; a dropped one only counts and takes its seq."""
        if self.expected is not None and batch.seq != self.expected:
            raise Resync(f"batch {batch.seq} out of order (expected {self.expected})")
        if isinstance(batch, Dropped):
            self.bad(batch.why)
        else:
            if batch.malformed:
                self.malformed(batch)
            changes = self.translator.apply(batch.events)
            if changes and not self.sink.apply(changes):
                raise Resync("the sink lost its state")
            if batch.ts is not None:
                self.last_ts = batch.ts
            self.stats.batches += 1
        self.expected = batch.seq + 1

    def bad(self, why: str) -> None:
        self.stats.bad_batches += 1
        if worth_a_line(self.stats.bad_batches):
            log.warning("kv events of %s: dropped a bad batch (%d so far): %s", self.name, self.stats.bad_batches, why)

    def malformed(self, batch: EngineBatch) -> None:
        """Count a batch's malformed events; the warning names only the first few (the decoder
        keeps no more), so a batch of a million costs one bounded line."""
        self.stats.bad_events += batch.malformed
        self.batches_with_bad_events += 1
        if worth_a_line(self.batches_with_bad_events):
            log.warning(
                "kv events of %s: batch %d: %d malformed event(s) (%d so far), left out but for "
                "a clear or the removals they name: %s",
                self.name,
                batch.seq,
                batch.malformed,
                self.stats.bad_events,
                "; ".join(batch.reasons),
            )


def worth_a_line(n: int) -> bool:
    """Log the first and every 1000th of a kind: a publisher whose every step is malformed (a
    version whose fields this decoder refuses) would otherwise log a line a step."""
    return n == 1 or n % 1000 == 0


class Gap(Resync):
    """Live batch `batch` came after a gap."""

    def __init__(self, batch: Received):
        super().__init__(f"gap before seq {batch.seq}")
        self.batch = batch
