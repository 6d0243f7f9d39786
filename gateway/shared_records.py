"""Records gateway replicas share through Redis (`--redis`) about the Responses API: which vLLM
worker holds a response (gateway/shared_response_ids.py) and the responses the gateway stores
for kvgate's workers (gateway/shared_response_store.py). Both are written as an answer goes out
and read by a replica that does not know an id.

**A record is in Redis before the client can name it**: the write goes out as the answer is
relayed, and the answer holds back what names the response (a vLLM answer's id, the end of a
kvgate worker's) until Redis has acknowledged the write (`held`), for at most `wait_s`. A client
may send its follow-up to another replica the instant it reads the response; that replica's
lookup then comes after the acknowledgement and finds the record. Waiting at the reader instead
(a miss read again for a while) cannot know how long a record takes to come or whether one ever
will: every unknown id's 404 would pay the wait, and an unknown id waiting where another
tenant's is found at once would tell the two apart. The hold costs an answer one Redis round
trip.

Redis slower than `wait_s` (WRITE_WAIT_S: a new connection's connect and answer timeouts): the
answer goes on, the write with it, and a follow-up at another replica before it lands is a 404.
Redis failing (its last command here failed): the answer is not held, the write is still sent;
the other replicas' lookups in the same Redis fail too, and there an unknown id and another
tenant's are both a 503, never a 404 (gateway/responses.py), so an outage costs one answer the
wait, not each one.
"""

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from workers.background import background
from workers.kv import redis_schema as rs

log = logging.getLogger("kvgate.gateway")

REDIS_TIMEOUT_S = 0.25
WRITE_WAIT_S = 2 * REDIS_TIMEOUT_S
BACK_OFF_S = 1.0  # after a failure, how long a check that can be done without is not asked
T = TypeVar("T")


class LookupFailed(Exception):
    """Redis did not answer a lookup: whether the id is known elsewhere cannot be said."""


class SharedRecords:
    """One kind of record in Redis at `url`, signed with `token` (the fleet's internal token);
    `what` names them in the log, `kept` what stays with this replica while Redis fails."""

    def __init__(self, url: str, token: str, what: str, kept: str, wait_s: float = WRITE_WAIT_S):
        if not token:
            raise ValueError(f"the shared {what} need the fleet's internal token to sign their records")
        self.url, self.token, self.what, self.kept, self.wait_s = url, token, what, kept, wait_s
        self.redis: aioredis.Redis | None = None
        self.failing = False
        self.failed_at = 0.0  # time.monotonic() of the last failure
        self.malformed = 0  # records read back and dropped

    def client(self) -> aioredis.Redis:
        if self.redis is None:
            self.redis = aioredis.from_url(
                self.url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
            )
        return self.redis

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()

    async def read(self, key: str, unless: str | None = None) -> tuple[bytes, float] | None:
        """The value Redis holds at `key` and the seconds it has left, or None (absent, expiring
        now, or `unless` is a key Redis holds: a mark that the record is gone, read in the same
        round trip). Raises LookupFailed when Redis does not answer."""
        try:
            async with self.client().pipeline(transaction=False) as p:
                p.get(key)
                p.pttl(key)
                if unless is not None:
                    p.exists(unless)
                raw, ttl_ms, *marked = await p.execute()
            self.answered()
        except (RedisError, OSError) as e:
            self.failed(e)
            raise LookupFailed(f"redis did not answer: {type(e).__name__}") from None
        if raw is None or not isinstance(ttl_ms, int) or ttl_ms <= 0 or any(marked):
            return None
        return raw, ttl_ms / 1000.0

    def backing_off(self) -> bool:
        """Whether Redis failed within the last BACK_OFF_S: a check a replica can do without is
        then not asked (each would wait out the timeout)."""
        return self.failing and time.monotonic() - self.failed_at < BACK_OFF_S

    def held(self, write: Coroutine[Any, Any, None]) -> "asyncio.Future[None] | None":
        """Run `write` in the background (the caller is answering); returns what the answer holds
        on: done once Redis has answered the write (or failed it), at most `wait_s` later, the
        write going on; None while Redis is failing."""
        written = background(write)
        return None if self.failing else background(self._answered_within(written))

    async def _answered_within(self, write: "asyncio.Future[None]") -> None:
        await asyncio.wait({write}, timeout=self.wait_s)

    def answered(self) -> None:
        if self.failing:
            log.warning("%s: redis at %s answers again", self.what, rs.redact_url(self.url))
        self.failing = False

    def failed(self, e: Exception) -> None:
        if not self.failing:
            log.warning(
                "%s: redis at %s failed (%r): %s meanwhile stay with this replica",
                self.what,
                rs.redact_url(self.url),
                e,
                self.kept,
            )
        self.failing, self.failed_at = True, time.monotonic()

    def parsed(self, response_id: str, check: Callable[[], T]) -> T | None:
        """The record `check` reads back, or None where it is not one of this fleet's (its
        ValueError): `dropped`."""
        try:
            return check()
        except ValueError as e:
            self.dropped(response_id, e)
            return None

    def dropped(self, response_id: str, e: ValueError) -> None:
        """A record read back and dropped: counted, and logged the first and every 1000th time."""
        self.malformed += 1
        if self.malformed == 1 or self.malformed % 1000 == 0:
            log.warning(
                "%s: dropped a record read from redis (%d so far): %r: %s", self.what, self.malformed, response_id, e
            )
