"""Per-key rate limits: token buckets for requests and tokens per minute.

A limit of N per minute is a bucket of N that refills at N/60 per second, so a key may burst
up to a minute's worth and then runs at its rate. With Redis the buckets live there (one Lua
script takes from a bucket atomically, on Redis's clock), so gateway replicas share each key's
limit; without Redis, or while Redis does not answer, each replica keeps its own buckets.
"""

import logging
import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from workers.kv import redis_schema as rs

log = logging.getLogger("kvgate.gateway")

REDIS_TIMEOUT_S = 0.25
REDIS_RETRY_S = 1.0

# KEYS[1] = the bucket; ARGV = capacity, refill per second, cost. Returns {admitted, wait_s}.
TAKE = """
local cap, rate, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local s = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(s[1]) or cap
local ts = tonumber(s[2]) or now
tokens = math.min(cap, tokens + math.max(0, now - ts) * rate)
if tokens >= cost then
  redis.call('HSET', KEYS[1], 'tokens', tokens - cost, 'ts', now)
  redis.call('PEXPIRE', KEYS[1], math.ceil(cap / rate * 1000) + 1000)
  return {1, '0'}
end
return {0, tostring((cost - tokens) / rate)}
"""


@dataclass(frozen=True)
class Limit:
    """`per_minute` units (requests or tokens) for one key; `name` is `rpm` or `tpm`."""

    name: str
    per_minute: int

    @property
    def rate(self) -> float:
        return self.per_minute / 60.0


def take(state: tuple[float, float] | None, limit: Limit, cost: float, now: float) -> tuple[tuple[float, float], float]:
    """One bucket step: (tokens, ts) after taking `cost` at `now`, and the wait (0.0 when
    admitted; `inf` when `cost` exceeds the whole bucket). A refused take changes nothing."""
    tokens, ts = state if state is not None else (float(limit.per_minute), now)
    tokens = min(float(limit.per_minute), tokens + max(0.0, now - ts) * limit.rate)
    if cost > limit.per_minute:
        return (tokens, now), math.inf
    if tokens >= cost:
        return (tokens - cost, now), 0.0
    return (tokens, now), (cost - tokens) / limit.rate


class RateLimiter:
    def __init__(self, redis_url: str | None = None):
        self.redis_url = redis_url
        self._local: dict[str, tuple[float, float]] = {}
        self._redis: aioredis.Redis | None = None
        self._script: AsyncScript | None = None
        self._redis_down_until = 0.0
        self._redis_failing = False

    async def acquire(self, key_name: str, limit: Limit, cost: float) -> float:
        """Take `cost` from `key_name`'s `limit` bucket: 0.0 when admitted, else the seconds to
        wait before it would be (`inf`: never, the cost exceeds the limit)."""
        if cost > limit.per_minute:
            return math.inf
        bucket = rs.ratelimit_key(key_name, limit.name)
        if self.redis_url and time.monotonic() >= self._redis_down_until:
            try:
                wait = await self._acquire_redis(bucket, limit, cost)
                if self._redis_failing:
                    log.warning(
                        "rate limits: redis at %s answers again; limits are shared again", rs.redact_url(self.redis_url)
                    )
                self._redis_failing = False
                return wait
            except (RedisError, OSError) as e:
                if not self._redis_failing:
                    log.warning(
                        "rate limits: redis at %s failed (%r); limiting per replica until it answers",
                        rs.redact_url(self.redis_url),
                        e,
                    )
                self._redis_failing = True
                self._redis_down_until = time.monotonic() + REDIS_RETRY_S
        self._local[bucket], wait = take(self._local.get(bucket), limit, cost, time.monotonic())
        return wait

    async def _acquire_redis(self, bucket: str, limit: Limit, cost: float) -> float:
        assert self.redis_url is not None, "acquire reaches Redis only when it has a URL"
        if self._redis is None or self._script is None:
            self._redis = aioredis.from_url(
                self.redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
            )
            self._script = self._redis.register_script(TAKE)
        admitted, wait = await self._script(keys=[bucket], args=[limit.per_minute, limit.rate, cost])
        return 0.0 if admitted else float(wait)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
