"""A prefill worker's lookup of decode peers' NIXL layouts (workers/nixl_peers.py), in one
process: a dict for Redis and an in-process peer for `GET /kv/nixl`. Cached per agent, read
from Redis first when its record is signed with the fleet token, else from the peer; a peer
that restarted (a new agent behind the same URL) drops the old agent from the cache and NIXL."""

import asyncio
import json

import httpx
import pytest

from workers.kv import redis_schema as rs
from workers.nixl_layout import CacheLayout
from workers.nixl_peers import PeerLayouts

TOKEN = "peers-token"
POOL = "m"
URL = "http://decode:1"


def layout(agent: str) -> CacheLayout:
    return CacheLayout(agent, "bWQ=", "DRAM", 0, 4096, 16, 4, 64)


class FakeRedis:
    """The one call PeerLayouts makes of Redis."""

    def __init__(self):
        self.values: dict[str, str] = {}

    def publish(self, agent: str, token: str = TOKEN) -> None:
        rec = rs.AgentRecord("d", agent, layout(agent).to_json()).signed(token)
        self.values[rs.nixl_key(POOL, agent)] = json.dumps(rec.to_json())

    async def get(self, key: str) -> str | None:
        return self.values.get(key)

    async def aclose(self) -> None:
        pass


class Peer:
    """The decode worker's `GET /kv/nixl`, running `agent`."""

    def __init__(self, agent: str):
        self.agent, self.asked = agent, 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.asked += 1
        return httpx.Response(200, json=layout(self.agent).to_json())


def lookups(redis: FakeRedis | None, peer: Peer, agents: list[str]) -> tuple[PeerLayouts, list[str], list]:
    """Look each of `agents` up at URL in turn: (the lookups, the agents forgotten, the layouts)."""
    forgotten: list[str] = []
    peers = PeerLayouts(TOKEN, forgotten.append)
    if redis is not None:
        peers.use_redis("redis://unused", POOL)
        peers._redis = redis  # type: ignore[assignment]

    async def run() -> list:
        async with httpx.AsyncClient(transport=httpx.MockTransport(peer.handle)) as client:
            return [await peers.get(client, URL, a, {}) for a in agents]

    return peers, forgotten, asyncio.run(run())


def test_a_layout_comes_from_redis_once_then_from_the_cache():
    redis, peer = FakeRedis(), Peer("d-1")
    redis.publish("d-1")
    peers, forgotten, got = lookups(redis, peer, ["d-1", "d-1", "d-1"])
    assert got == [layout("d-1")] * 3 and peer.asked == 0
    assert peers.lookups == {"cache": 2, "redis": 1, "http": 0} and forgotten == []


def test_a_restarted_peer_invalidates_the_old_agent():
    """The same URL grants from a new agent: its layout is looked up afresh, and the old agent
    is dropped from the cache and forgotten by NIXL (its metadata is a dead process's)."""
    redis, peer = FakeRedis(), Peer("d-1")
    redis.publish("d-1")
    redis.publish("d-2")
    peers, forgotten, got = lookups(redis, peer, ["d-1", "d-1", "d-2", "d-2"])
    assert [g.agent for g in got] == ["d-1", "d-1", "d-2", "d-2"]
    assert peers.lookups == {"cache": 2, "redis": 2, "http": 0}
    assert forgotten == ["d-1"] and set(peers._layouts) == {"d-2"}


def test_without_a_record_in_redis_the_peer_is_asked():
    redis, peer = FakeRedis(), Peer("d-1")
    peers, _, got = lookups(redis, peer, ["d-1", "d-1"])
    assert got == [layout("d-1")] * 2 and peer.asked == 1
    assert peers.lookups == {"cache": 1, "redis": 0, "http": 1}


def test_a_record_signed_with_another_token_is_ignored():
    """Whoever writes to Redis without the fleet token cannot point our WRITEs at their memory."""
    redis, peer = FakeRedis(), Peer("d-1")
    redis.publish("d-1", token="not-the-fleet's")
    peers, _, got = lookups(redis, peer, ["d-1"])
    assert got == [layout("d-1")] and peers.lookups["http"] == 1 and peer.asked == 1


def test_without_redis_the_peer_is_asked():
    peers, _, _ = lookups(None, Peer("d-1"), ["d-1"])
    assert peers.lookups == {"cache": 0, "redis": 0, "http": 1}


def test_a_peer_running_another_agent_than_granted_is_an_error():
    with pytest.raises(ValueError, match="not the granted"):
        lookups(FakeRedis(), Peer("d-2"), ["d-1"])


def test_sends_at_once_share_one_lookup():
    """The batches of one prompt are sent together: one Redis GET answers them all."""
    redis, peer = FakeRedis(), Peer("d-1")
    redis.publish("d-1")
    peers = PeerLayouts(TOKEN, lambda agent: None)
    peers.use_redis("redis://unused", POOL)
    peers._redis = redis  # type: ignore[assignment]

    async def run() -> list:
        async with httpx.AsyncClient(transport=httpx.MockTransport(peer.handle)) as client:
            return await asyncio.gather(*(peers.get(client, URL, "d-1", {}) for _ in range(4)))

    assert asyncio.run(run()) == [layout("d-1")] * 4
    assert peers.lookups == {"cache": 3, "redis": 1, "http": 0}
