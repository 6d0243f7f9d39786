"""Where a prefill worker finds the cache layout (with the NIXL agent metadata) of the decode
worker it WRITEs into: its own cache first, else Redis, else the peer's `GET /kv/nixl`.

Looked up by the agent name the peer's reservation answers, after the reservation: an agent
name is new at each start of a worker, so a cached layout is never stale, and a peer that
restarted names an agent not seen before. When the agent behind a URL changes, the old one is
dropped from the cache and forgotten by our NIXL agent. The batches of one prompt, sent at once,
share one lookup. Redis (`--redis`) holds each NIXL
worker's signed AgentRecord under `nixl_key(pool, agent)`: a lookup there costs one GET to a
store every worker already talks to, not a request to the peer's HTTP server, which is busy
serving. A record missing, unsigned or signed by another token falls back to HTTP.
"""

import asyncio
import logging
from collections.abc import Callable

import httpx
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from workers.kv import redis_schema as rs
from workers.nixl_layout import CacheLayout
from workers.strict_json import peer_object

log = logging.getLogger("kvgate.transfer")

LOOKUP_SOURCES = ("cache", "redis", "http")
REDIS_TIMEOUT_S = 0.5  # a lookup spends the reservation's time: a slow Redis goes to HTTP soon


class PeerLayouts:
    """Peer layouts by agent name, for a worker whose fleet token is `token`; `forget(agent)`
    drops a peer agent from our NIXL agent. `lookups` counts where each layout came from."""

    def __init__(self, token: str | None, forget: Callable[[str], None]):
        self.token = token
        self.forget = forget
        self.redis_url: str | None = None
        self.pool = ""
        self._redis: aioredis.Redis | None = None
        self._layouts: dict[str, CacheLayout] = {}  # agent -> its layout
        self._finding: dict[str, asyncio.Task] = {}  # agent -> its lookup under way
        self._agents: dict[str, str] = {}  # peer URL -> the agent its last grant named
        self.lookups = dict.fromkeys(LOOKUP_SOURCES, 0)

    def use_redis(self, url: str, pool: str) -> None:
        """Look layouts up in the Redis at `url` (the pool's AgentRecords) before asking peers."""
        self.redis_url, self.pool = url, pool

    async def get(self, client: httpx.AsyncClient, url: str, agent: str, headers: dict[str, str]) -> CacheLayout:
        """The layout of `agent`, which the peer at `url` runs; raises ValueError when neither
        Redis nor the peer has it."""
        old = self._agents.get(url)
        if old is not None and old != agent:
            self.drop(old)
        self._agents[url] = agent
        if agent in self._layouts:
            self.lookups["cache"] += 1
            return self._layouts[agent]
        task = self._finding.get(agent)
        if task is None:
            task = self._finding[agent] = asyncio.ensure_future(self._find(client, url, agent, headers))
            task.add_done_callback(lambda _: self._finding.pop(agent, None))
        else:
            self.lookups["cache"] += 1  # another send's lookup answers this one
        return await asyncio.shield(task)

    async def _find(self, client: httpx.AsyncClient, url: str, agent: str, headers: dict) -> CacheLayout:
        layout = await self._from_redis(agent)
        source = "redis"
        if layout is None:
            layout, source = await self._from_http(client, url, agent, headers), "http"
        self.lookups[source] += 1
        self._layouts[agent] = layout
        return layout

    def drop(self, agent: str) -> None:
        """Forget `agent`'s layout and metadata: it restarted, or a WRITE to it failed."""
        self._layouts.pop(agent, None)
        self.forget(agent)

    async def _from_redis(self, agent: str) -> CacheLayout | None:
        if self.redis_url is None or not self.token:
            return None
        try:
            raw = await self._client().get(rs.nixl_key(self.pool, agent))
        except (RedisError, OSError) as e:
            log.warning("NIXL agent %s: redis lookup failed (%r); asking the peer", agent, e)
            return None
        if raw is None:
            return None
        try:
            rec = rs.AgentRecord.from_json(peer_object(raw, "a NIXL agent record"))
            why = rec.why_invalid(self.token) or (None if rec.agent == agent else "another agent's")
            if why is not None:
                raise ValueError(why)
            return CacheLayout.from_json(rec.layout)
        except ValueError as e:
            log.warning("NIXL agent %s: ignoring its redis record (%s); asking the peer", agent, e)
            return None

    async def _from_http(self, client: httpx.AsyncClient, url: str, agent: str, headers: dict) -> CacheLayout:
        try:
            r = await client.get(url.rstrip("/") + "/kv/nixl", headers=headers)
            r.raise_for_status()
            layout = CacheLayout.from_json(peer_object(r.content, "a NIXL layout"))
        except httpx.HTTPError as e:
            raise ValueError(f"no NIXL layout from {url}: {e!r}") from e
        if layout.agent != agent:
            raise ValueError(f"{url} runs NIXL agent {layout.agent}, not the granted {agent}")
        return layout

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            assert self.redis_url is not None
            self._redis = aioredis.from_url(
                self.redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
            )
        return self._redis

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
