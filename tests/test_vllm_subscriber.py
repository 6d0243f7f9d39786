"""The ZMQ subscriber against a fake vLLM publisher speaking vLLM's wire protocol on loopback:
replay on start, a gap filled by replay, a gap the publisher can no longer fill, a restart,
both bind directions, and no replay endpoint at all."""

import asyncio
import functools
import time
from collections import deque
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, generate_latest

from gateway.index import ResidencyIndex
from gateway.vllm_batch import EngineBatch
from gateway.vllm_subscriber import Subscriber
from gateway.vllm_translate import Translator
from gateway.vllm_worker import IndexSink, VllmKind
from tests import vllm_data as vd
from tests import vllm_malformed as vm
from gateway.procs import free_port, wait_until

WID = "vllm@test"


class FakeVllm:
    """vLLM's ZmqEventPublisher in miniature: PUB [topic, seq, payload], a ROUTER answering
    [b"", start] with [b"", topic, seq, payload]... and the end marker, a bounded replay buffer."""

    def __init__(self, ctx, pub: str, replay: str, bind_pub: bool = True, buffer: int = 10_000):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(pub) if bind_pub else self.pub.connect(pub)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(replay)
        self.buffer: deque = deque(maxlen=buffer)
        self.seq = 0
        self.task = asyncio.ensure_future(self.serve())

    async def serve(self):
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq, frames in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", *frames])
            await self.router.send_multipart([client, b"", b"", vd.END, b""])

    async def publish(self, events: list, send: bool = True) -> int:
        return await self.publish_payload(vd.payload(events, ts=time.time()), send)

    async def publish_payload(self, payload: bytes, send: bool = True) -> int:
        return await self.publish_frames([b"kv", self.seq.to_bytes(8, "big"), payload], send)

    async def publish_frames(self, frames: list[bytes], send: bool = True) -> int:
        """The next batch as `frames`, whatever they hold, live and in the replay buffer."""
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, frames))
        if send:
            await self.pub.send_multipart(frames)
        return seq

    def restart(self):
        """A new process: numbering from 0, an empty cache and replay buffer."""
        self.seq = 0
        self.buffer.clear()

    def close(self):
        self.task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


def block(i: int) -> tuple[dict, list[int]]:
    """A root block of 32 tokens, engine hash `i`."""
    tokens = list(range(1000 + 32 * i, 1032 + 32 * i))
    return vd.stored([i], tokens), tokens


until = functools.partial(wait_until, timeout=10.0)


def resident(index: ResidencyIndex) -> int:
    return index.num_blocks(WID)


async def scenario(body, bind_pub=True, with_replay=True, buffer=10_000):
    ctx = zmq.asyncio.Context()
    port, rport = free_port(), free_port()
    pub_addr = f"tcp://127.0.0.1:{port}"
    fake = FakeVllm(ctx, pub_addr, f"tcp://127.0.0.1:{rport}", bind_pub, buffer)
    index = ResidencyIndex()
    sub = Subscriber(
        pub_addr,
        not bind_pub,
        f"tcp://127.0.0.1:{rport}" if with_replay else None,
        "kv",
        Translator(vd.MODEL, 16),
        IndexSink(index, WID, lambda: False),
        WID,
        ctx,
    )
    task = None
    try:

        async def start():
            nonlocal task
            task = asyncio.ensure_future(sub.run())
            await until(sub.synced.is_set)

        await body(fake, sub, index, start)
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        fake.close()
        ctx.term()


def test_history_is_replayed_on_start_then_live_batches_follow():
    async def body(fake, sub, index, start):
        for i in range(3):
            await fake.publish([block(i)[0]])  # no subscriber yet: only the replay buffer keeps them
        await fake.publish([vd.removed([1])])
        await start()
        assert resident(index) == 2 * 2 and sub.stats.history_from == 0 and sub.stats.replayed == 4
        await asyncio.sleep(0.2)  # let the SUB connection settle (ZMQ drops messages to a joining subscriber)
        await fake.publish([block(7)[0]])
        await until(lambda: resident(index) == 3 * 2)
        assert index.match(vd.ours(block(7)[1])) == {WID: 2}
        assert index.match(vd.ours(block(1)[1])) == {}

    asyncio.run(scenario(body))


def test_a_gap_is_filled_from_the_replay_buffer():
    async def body(fake, sub, index, start):
        await start()
        await asyncio.sleep(0.2)
        await fake.publish([block(0)[0]])
        await fake.publish([block(1)[0]], send=False)  # lost on the way
        await fake.publish([block(2)[0]])
        await until(lambda: resident(index) == 3 * 2)
        assert sub.stats.gaps >= 1 and sub.stats.syncs == 1

    asyncio.run(scenario(body))


def test_a_first_batch_lost_to_a_joining_subscriber_is_replayed():
    async def body(fake, sub, index, start):
        await start()  # nothing published yet: the replay is empty
        await fake.publish([block(0)[0]], send=False)  # seq 0 lost (ZMQ drops to a joining SUB)
        await fake.publish([block(1)[0]])
        await until(lambda: resident(index) == 2 * 2)
        assert index.match(vd.ours(block(0)[1])) == {WID: 2}

    asyncio.run(scenario(body))


def test_a_gap_the_publisher_no_longer_holds_resyncs_from_what_it_has():
    async def body(fake, sub, index, start):
        await start()
        await asyncio.sleep(0.2)
        await fake.publish([block(0)[0]])
        await until(lambda: resident(index) == 2)
        for i in range(1, 5):
            await fake.publish([block(i)[0]], send=False)  # lost, and the 2-batch buffer forgets 1 and 2
        await fake.publish([block(5)[0]])
        await until(lambda: sub.stats.syncs == 2 and sub.synced.is_set() and resident(index) == 2 * 2)
        assert sub.stats.history_from == 4  # seqs 4, 5 held; blocks 0-3 are unknown now (an under-statement)
        assert index.match(vd.ours(block(0)[1])) == {}

    asyncio.run(scenario(body, buffer=2))


def test_a_restarted_publisher_is_followed_from_its_new_history():
    async def body(fake, sub, index, start):
        await start()
        await asyncio.sleep(0.2)
        for i in range(4):
            await fake.publish([block(i)[0]])
        await until(lambda: resident(index) == 4 * 2)
        fake.restart()
        await asyncio.sleep(0.01)
        await fake.publish([block(9)[0]])  # seq 0 again, and newer
        await until(lambda: sub.stats.restarts == 1 and sub.synced.is_set() and resident(index) == 2)
        assert index.match(vd.ours(block(9)[1])) == {WID: 2} and index.match(vd.ours(block(0)[1])) == {}

    asyncio.run(scenario(body))


def test_a_batch_whose_ts_is_malformed_applies_and_a_later_restart_is_still_seen():
    """A batch dropped for its ts kept the blocks it removed resident."""

    async def body(fake, sub, index, start):
        await start()
        await asyncio.sleep(0.2)
        await fake.publish([block(0)[0]])
        await fake.publish_payload(vm.payload(vd.removed([0]), block(1)[0], ts=float("nan")))
        await until(lambda: sub.expected == 2)
        assert index.match(vd.ours(block(0)[1])) == {} and index.match(vd.ours(block(1)[1])) == {WID: 2}
        assert sub.stats.bad_events == 1 and sub.stats.bad_batches == 0
        fake.restart()
        await asyncio.sleep(0.01)
        await fake.publish([block(9)[0]])
        await until(lambda: sub.stats.restarts == 1 and sub.synced.is_set() and resident(index) == 2)

    asyncio.run(scenario(body))


def test_a_batch_below_the_expected_seq_whose_ts_did_not_read_is_a_duplicate():
    """Without a ts it cannot tell a restart (comparing None with the last ts raised TypeError)."""
    sink = IndexSink(ResidencyIndex(), WID, lambda: False)
    sub = Subscriber("tcp://127.0.0.1:1", False, None, "kv", Translator(vd.MODEL, 16), sink, WID)
    sub.expected, sub.last_ts = 5, 1.0
    sub.receive(EngineBatch(3, None, ()))
    assert sub.stats.duplicates == 1 and sub.stats.restarts == 0 and sub.expected == 5


def test_a_connecting_publisher_reaches_a_binding_subscriber():
    async def body(fake, sub, index, start):
        await start()
        assert sub.bind
        await asyncio.sleep(0.3)
        await fake.publish([block(0)[0]])
        await until(lambda: resident(index) == 2)

    asyncio.run(scenario(body, bind_pub=False))


def test_without_a_replay_endpoint_live_batches_still_apply_and_a_gap_resyncs():
    async def body(fake, sub, index, start):
        await fake.publish([block(0)[0]])  # before the subscriber: unknown for good
        await start()
        await asyncio.sleep(0.2)
        await fake.publish([block(1)[0]])
        await until(lambda: resident(index) == 2)
        await fake.publish([block(2)[0]], send=False)
        await fake.publish([block(3)[0]])
        await until(lambda: sub.stats.syncs == 2)
        await fake.publish([block(4)[0]])
        await until(lambda: index.match(vd.ours(block(4)[1])) == {WID: 2})

    asyncio.run(scenario(body, with_replay=False))


# Payloads whose events' ends are unknown: no batch at all, stepped over whole.
TRIGGERS = [
    vm.MALFORMED["nested past msgpack's stack"],
    vm.MALFORMED["reserved byte in an event"],
    vm.MALFORMED["trailing bytes"],
]


def test_bad_live_batches_are_counted_and_stepped_over_and_the_next_one_applies():
    async def body(fake, sub, index, start):
        await start()
        await asyncio.sleep(0.2)
        await fake.publish([block(0)[0]])
        for payload in TRIGGERS:
            await fake.publish_payload(payload)
        await fake.publish([block(1)[0]])
        await until(lambda: resident(index) == 2 * 2)
        assert sub.stats.bad_batches == 3 and sub.stats.syncs == 1 and sub.stats.restarts == 0
        assert index.match(vd.ours(block(1)[1])) == {WID: 2} and sub.expected == 5

    asyncio.run(scenario(body))


def test_bad_batches_in_the_replay_buffer_are_stepped_over_by_the_sync():
    """They stay in the publisher's buffer, so a resync would meet them again: the sync itself
    passes over them, and the subscriber goes on with the live batches."""

    async def body(fake, sub, index, start):
        await fake.publish([block(0)[0]])
        for payload in TRIGGERS:
            await fake.publish_payload(payload)
        await fake.publish([block(1)[0]])
        await start()
        assert resident(index) == 2 * 2 and sub.stats.bad_batches == 3 and sub.stats.replayed == 5
        await asyncio.sleep(0.2)
        await fake.publish([block(2)[0]])
        await until(lambda: resident(index) == 3 * 2)
        assert sub.stats.syncs == 1 and sub.stats.bad_batches == 3

    asyncio.run(scenario(body))


def test_a_bad_batch_after_a_gap_is_stepped_over_by_the_replay_that_fills_the_gap():
    """A batch the decoder rejected was dropped live, so the next one looked like a gap, whose
    replay brought it back and resynced, and every resync replayed it again."""

    async def body(fake, sub, index, start):
        await start()
        await asyncio.sleep(0.2)
        await fake.publish([block(0)[0]])
        await fake.publish([block(1)[0]], send=False)
        await fake.publish_payload(vm.MALFORMED["events a map"])
        await fake.publish([block(3)[0]])
        await until(lambda: resident(index) == 3 * 2)
        assert sub.stats.bad_batches == 1 and sub.stats.gaps >= 1 and sub.stats.syncs == 1
        await fake.publish([block(4)[0]])
        await until(lambda: resident(index) == 4 * 2)

    asyncio.run(scenario(body))


def test_a_batch_with_malformed_events_applies_its_others_and_counts_them(caplog):
    """Its removals among them: a batch dropped whole for one bad event (a map keyed by an array,
    once) left the blocks it removed resident. Replayed at sync or live, each bad event counts; a warning is bounded and
    only the first batch of bad events and every 1000th get one (a publisher's every step may be
    malformed)."""

    async def body(fake, sub, index, start):
        await fake.publish([block(0)[0], block(1)[0]])
        await fake.publish_payload(vm.payload(vd.removed([0]), vm.BAD_EVENTS["array key"], block(2)[0]))
        await start()
        assert index.match(vd.ours(block(0)[1])) == {} and index.match(vd.ours(block(2)[1])) == {WID: 2}
        assert sub.stats.bad_events == 1 and sub.stats.bad_batches == 0 and sub.stats.batches == 2
        await asyncio.sleep(0.2)
        await fake.publish([*({"type": "Nope"} for _ in range(10_000)), vd.removed([1])])
        await until(lambda: sub.expected == 3)
        assert index.match(vd.ours(block(1)[1])) == {} and resident(index) == 2
        assert sub.stats.bad_events == 10_001 and sub.stats.bad_batches == 0 and sub.stats.syncs == 1

    with caplog.at_level("WARNING", logger="kvgate.gateway"):
        asyncio.run(scenario(body))
    skips = [r.getMessage() for r in caplog.records if "malformed event" in r.getMessage()]
    assert len(skips) == 1 and "batch 1: 1 malformed event(s) (1 so far)" in skips[0]
    assert all(len(m) < 500 for m in skips)


def test_bad_batches_and_bad_events_are_exported_per_worker():
    """The gateway's vLLM kind (a collector of its registry) exports the subscriber's counts."""

    async def body(fake, sub, index, start):
        await fake.publish_payload(TRIGGERS[0])
        await fake.publish([block(0)[0], {"type": "Nope"}, {"type": "Nope"}])
        await start()
        kind, registry = VllmKind(), CollectorRegistry()
        kind.links["u"] = SimpleNamespace(wid=WID, stats=(sub.stats, sub.translator.stats))
        registry.register(kind)
        metric = functools.partial(registry.get_sample_value, labels={"worker": WID})
        assert metric("kvgate_gateway_vllm_event_bad_batches_total") == 1
        assert metric("kvgate_gateway_vllm_event_bad_events_total") == 2
        text = generate_latest(registry).decode()
        assert "# HELP kvgate_gateway_vllm_event_bad_events_total Malformed KV events" in text

    asyncio.run(scenario(body))


# Messages whose seq does not read: a seq frame of 7 bytes, a frame too many.
UNREADABLE = {
    "short seq": lambda payload: [b"kv", b"\x00" * 7, payload],
    "extra frame": lambda payload: [b"kv", b"\x00" * 8, payload, b""],
}


@pytest.mark.parametrize("shape", list(UNREADABLE))
def test_a_replayed_message_without_a_readable_seq_is_stepped_over_after_the_previous_one(shape):
    """The publisher replays in seq order, so it is the batch after the one before it; failing
    the sync instead met the same bytes at every resync, forever."""

    async def body(fake, sub, index, start):
        await fake.publish([block(0)[0]])
        await fake.publish_frames(UNREADABLE[shape](vd.payload([block(1)[0]])))
        await fake.publish([block(2)[0]])
        await start()
        assert resident(index) == 2 * 2 and index.match(vd.ours(block(1)[1])) == {}
        assert sub.stats.bad_batches == 1 and sub.stats.syncs == 1 and sub.expected == 3
        assert sub.stats.history_from == 0
        await asyncio.sleep(0.2)
        await fake.publish([block(3)[0]])
        await until(lambda: resident(index) == 3 * 2)
        assert sub.stats.syncs == 1 and sub.stats.gaps == 0

    asyncio.run(scenario(body))


def test_the_first_message_of_a_replay_from_0_without_a_readable_seq_only_counts():
    """Its seq cannot be known (the publisher may hold batches from any seq on): the next
    message sets the order."""

    async def body(fake, sub, index, start):
        await fake.publish_frames(UNREADABLE["short seq"](vd.payload([block(0)[0]])))
        await fake.publish([block(1)[0]])
        await start()
        assert resident(index) == 2 and sub.stats.bad_batches == 1 and sub.stats.syncs == 1
        assert sub.stats.history_from == 1 and sub.expected == 2

    asyncio.run(scenario(body))


def test_a_message_without_a_readable_seq_first_in_a_gap_replay_takes_the_seq_asked_for():
    """A replay asked from seq 1 starts with batch 1, so that is where it goes."""

    async def body(fake, sub, index, start):
        await start()
        await asyncio.sleep(0.2)
        await fake.publish([block(0)[0]])
        await fake.publish_frames(UNREADABLE["short seq"](vd.payload([block(1)[0]])), send=False)
        await fake.publish([block(2)[0]])
        await until(lambda: sub.expected == 3)
        assert resident(index) == 2 * 2 and index.match(vd.ours(block(2)[1])) == {WID: 2}
        assert sub.stats.bad_batches == 1 and sub.stats.gaps == 1 and sub.stats.syncs == 1

    asyncio.run(scenario(body))
