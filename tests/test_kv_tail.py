"""How the gateway applies a worker's KV-event lines (gateway.kv_tail): pure, no processes."""

import asyncio

from gateway.fleet import Fleet
from gateway.worker import Worker
from gateway.index import ResidencyIndex
from workers.kv.events import STORED, EventBatch, KVEvent

STATE = {"worker_id": "w", "model": "m", "waiting": 0, "running": 1}


def line(seq: int, hashes: tuple[int, ...], worker_id: str = "w", state: dict | None = None) -> dict:
    body = EventBatch(worker_id, [KVEvent(seq, STORED, hashes)], seq).to_json()
    return body | ({"state": state} if state is not None else {})


def synced_fleet() -> tuple[Fleet, Worker]:
    fleet = Fleet(ResidencyIndex())
    w = fleet.add("http://w")
    fleet.up(w, STATE)
    fleet.index.reset("w", [], 0)
    return fleet, w


def test_a_line_lands_its_blocks_and_its_state_as_a_poll_would():
    async def run():
        fleet, w = synced_fleet()
        assert fleet.tail.apply_line(w, "w", w.epoch, line(1, (11, 12), state={**STATE, "running": 3}))
        assert fleet.index.num_blocks("w") == 2 and fleet.index.seq("w") == 1
        assert w.state["running"] == 3 and w.state_rides
        assert fleet.tail.apply_line(w, "w", w.epoch, line(2, (13,)))  # no state: the last one stands
        assert fleet.index.num_blocks("w") == 3 and w.state["running"] == 3 and not w.state_rides

    asyncio.run(run())


def test_a_line_fetched_before_the_worker_went_down_or_changed_is_dropped():
    async def run():
        fleet, w = synced_fleet()
        epoch = w.epoch
        fleet.down(w, "test")
        fleet.up(w, STATE)
        fleet.index.reset("w", [], 0)
        assert not fleet.tail.apply_line(w, "w", epoch, line(1, (11,)))  # an older epoch's stream
        assert fleet.index.num_blocks("w") == 0
        assert not fleet.tail.apply_line(w, "other", w.epoch, line(1, (11,)))  # asked of another id
        assert fleet.index.num_blocks("w") == 0

    asyncio.run(run())


def test_a_gap_or_a_strange_worker_id_ends_the_stream_and_asks_for_a_snapshot():
    async def run():
        fleet, w = synced_fleet()
        assert not fleet.tail.apply_line(w, "w", w.epoch, line(3, (11,)))  # seq 1 and 2 are missing
        assert fleet.index.seq("w") is None  # the next round resyncs from /kv/snapshot
        fleet.index.reset("w", [], 0)
        assert not fleet.tail.apply_line(w, "w", w.epoch, line(1, (11,), worker_id="x"))
        assert fleet.index.seq("w") is None and fleet.index.num_blocks("w") == 0

    asyncio.run(run())


def test_while_redis_carries_a_worker_its_stream_is_left():
    async def run():
        fleet, w = synced_fleet()
        w.redis_residency = True
        assert not fleet.tail.apply_line(w, "w", w.epoch, line(1, (11,)))
        assert fleet.index.num_blocks("w") == 0

    asyncio.run(run())
