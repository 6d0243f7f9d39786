"""What a gateway replica or worker reads from Redis that another process wrote: heartbeats,
NIXL agent records, other replicas' in-flight tables and ledger entries, stream keys. Anything
that can write to Redis can write these: a malformed one is dropped (and counted where the
module counts them), never stops a loop and never grows memory for good. The stream test
runs over a test-started redis-server (never port 6379)."""

import asyncio
import json
import time

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.procs import start_redis, wait_redis
from gateway.redis_state import RedisState
from gateway.shared_ledger import MAX_HELD, SENT, LedgerNote
from policies.ledger import Sent
from tests.test_nixl_peers import POOL, URL, FakeRedis, Peer, layout, lookups
from workers.kv import redis_schema as rs
from workers.kv.events import STORED, KVEvent
from workers.nixl_peers import PeerLayouts

TOKEN = "secret"
DEEP = b"[" * 100_000


def state_of(fleet: Fleet | None = None) -> RedisState:
    return RedisState("redis://127.0.0.1:1/0", fleet or Fleet(ResidencyIndex()), TOKEN, replica_id="b")


def heartbeat(wid: str) -> bytes:
    """A heartbeat of worker `wid` in pool `p`, signed with the fleet's token."""
    reg = rs.Registration(wid, f"http://127.0.0.1:1/{wid}", "p", time.time()).signed(TOKEN)
    return json.dumps(reg.to_json()).encode()


def nested_state(depth: int) -> bytes:
    """A signed-looking heartbeat whose state nests `depth` objects deep."""
    state = b'{"a":' * depth + b"1" + b"}" * depth
    return b'{"worker_id":"w","url":"http://x","pool":"p","ts":1,"sig":"00","state":' + state + b"}"


class FakeRegistry:
    """The calls `RedisState` makes to read the registry: pool `p` with `beats` by worker id."""

    def __init__(self, beats: dict[str, bytes]):
        self.beats = beats

    async def smembers(self, key: str) -> set[bytes]:
        if key == rs.POOLS:
            return {b"p"}
        return {w.encode() for w in self.beats}

    async def mget(self, keys: list[str]) -> list[bytes | None]:
        return [self.beats.get(k.rsplit(":", 1)[1]) for k in keys]


@pytest.mark.parametrize("beat", [DEEP, b'{"a":' * 100_000, nested_state(600), nested_state(33)])
def test_a_heartbeat_nested_past_any_real_one_is_refused_not_raised(beat):
    """Such a heartbeat raised RecursionError (in json, or in the signature check's `asdict`),
    which no handler took: the bootstrap failed and the replica left Redis at every reconnect."""
    reg, why = state_of()._verify("p", "w", beat)
    assert reg is None and why.startswith("malformed")


def test_a_deeply_nested_heartbeat_leaves_the_rest_of_the_registry_read():
    fleet = Fleet(ResidencyIndex())
    state = state_of(fleet)
    asyncio.run(state.refresh_registry(FakeRegistry({"good": heartbeat("good"), "evil": DEEP})))
    assert set(state.registered) == {"good"} and state.ignored == 1 and state.rejected["evil"].startswith("malformed")
    assert [w.url for w in fleet.workers.values()] == ["http://127.0.0.1:1/good"]


def test_the_rejected_registrations_are_those_of_the_last_read_only():
    """One entry per bogus worker id, for good, was memory any writer to Redis could grow."""
    state = state_of()
    for batch in range(3):
        beats = {f"bogus-{batch}-{i}": b"{}" for i in range(5)}
        asyncio.run(state.refresh_registry(FakeRegistry({**beats, "good": heartbeat("good")})))
        assert set(state.rejected) == set(beats) and state.ignored == 5
    asyncio.run(state.refresh_registry(FakeRegistry({"good": heartbeat("good")})))
    assert state.rejected == {} and set(state.registered) == {"good"}


def test_a_deeply_nested_agent_record_in_redis_falls_back_to_the_peer():
    """As a record that does not parse: it raised RecursionError out of the WRITE's lookup."""
    redis, peer = FakeRedis(), Peer("d-1")
    redis.values[rs.nixl_key(POOL, "d-1")] = DEEP.decode()
    peers, _, got = lookups(redis, peer, ["d-1"])
    assert got == [layout("d-1")] and peer.asked == 1 and peers.lookups["http"] == 1


def test_a_peer_answering_deeply_nested_json_is_an_error():
    def deep(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=DEEP)

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(deep)) as client:
            await PeerLayouts(TOKEN, lambda _: None).get(client, URL, "d-1", {})

    with pytest.raises(ValueError, match="a NIXL layout"):
        asyncio.run(run())


@pytest.mark.parametrize(
    "table",
    [
        {b"w0": b"1000000", rs.SEQ_FIELD.encode(): b"1"},
        {b"w0": str(MAX_HELD + 1).encode()},
        {b"w0": b"-5", rs.SEQ_FIELD.encode(): b"1"},
        {b"w0": b"2", rs.SEQ_FIELD.encode(): b"-1"},
    ],
)
def test_an_in_flight_count_out_of_range_drops_the_table(table):
    state = state_of()
    assert state.share.table(table) is None and state.malformed["inflight_table"] == 1
    assert state.share.table({b"w0": str(MAX_HELD).encode(), rs.SEQ_FIELD.encode(): b"7"}) == (7, {"w0": MAX_HELD})


def test_the_entries_of_a_replica_never_listed_are_forgotten():
    """A replica's entries go when its table does; one that never lists itself in the replicas
    set has no table, and a fresh name at each note held its entries for good."""
    fleet = Fleet(ResidencyIndex())
    fleet.add("http://127.0.0.1:1/0").worker_id = "w0"
    w0 = fleet.by_id("w0")
    assert w0 is not None
    state = state_of(fleet)
    share = state.share
    share.ledgers.apply(LedgerNote("listed", SENT, "w0", "r1", Sent(1, (), 1)))
    share.ledgers.apply(LedgerNote("ghost", SENT, "w0", "r2", Sent(1, (), 1)))
    client = aioredis.from_url("redis://127.0.0.1:1/0")  # no command is sent: no table to read
    share.tables["listed"] = (0, {})
    asyncio.run(share.read_others(client, []))  # "listed" left the set: gone at once
    assert set(w0.ledger.sent) == {"ghost/r2"}, "a replica just started may list itself after a read"
    asyncio.run(share.read_others(client, []))
    assert not w0.ledger.sent and not share.ledgers.held


@pytest.mark.slow
def test_a_pool_whose_name_holds_a_colon_is_tailed_from_where_it_was_read(tmp_path):
    """The stream key of pool `llama3:8b` is `kvgate:llama3:8b:events`: its cursor was kept
    under `llama3`, so the same entries were read again and again and later ones never."""
    proc = wait_redis(start_redis(log_dir=str(tmp_path)))
    pool, key = "llama3:8b", rs.stream_key("llama3:8b")

    async def scenario() -> None:
        fleet = Fleet(ResidencyIndex())
        w = fleet.add("http://127.0.0.1:1/0")
        w.worker_id, w.redis_residency = "w0", True
        fleet.index.reset("w0", [], 0)
        state = RedisState(f"redis://127.0.0.1:{proc.port}/0", fleet, TOKEN, replica_id="b", interval=0.05)
        state.cursors[pool] = b"0-0"
        r = state.client()
        try:
            for seq in (1, 2, 3):
                last = await r.xadd(key, rs.encode_events("w0", [KVEvent(seq, STORED, (seq,))]))
            await state.read_streams(r)
            await state.read_streams(r)  # nothing new: nothing read again
            assert state.cursors == {pool: last} and fleet.index.seq("w0") == 3
            last = await r.xadd(key, rs.encode_events("w0", [KVEvent(4, STORED, (4,))]))
            await state.read_streams(r)
            assert state.cursors == {pool: last} and fleet.index.seq("w0") == 4 and fleet.index.holds("w0", 4)
            assert state.malformed["event_entry"] == 0
        finally:
            await r.aclose()

    try:
        asyncio.run(scenario())
    finally:
        proc.stop()
