"""The response ledger shared by gateway replicas through Redis (`--redis`).

A client's follow-up, retrieve or cancel may reach another replica than the one that relayed
the response's creation, so each replica writes every id it records to
`kvgate:response:{id}` (workers/kv/redis_schema.py) with the ledger's TTL, and a replica that
does not know an id looks it up there before it calls it unknown. A record is signed with the
fleet's internal token over the id, the worker, the tenant and whether its events can be
replayed (`Owner.replayable`): whoever can write to Redis but lacks the token can neither hand a
tenant's response to another tenant, nor point an id at another worker, nor make the gateway ask
a worker to replay what it kept no events of. A record read back is checked as every Redis
record is (bounded size, strict JSON, its fields' types and lengths); a bad one is counted and
taken as absent. Without Redis the ledger is each replica's own.

**The id reaches the client only once its record is in Redis**: the write goes out as the
answer is relayed, and the relay holds the bytes that complete the id until Redis has
acknowledged it (`put`; gateway/response_tap.py), for at most `wait_s`. A client may send its
follow-up to another replica the instant it reads the id; that replica's lookup then comes after
the acknowledgement and finds the record. Waiting at the reader instead (a miss read again for a
while) cannot know how long a record takes to come or whether one ever will: every unknown id's
404 would pay the wait, and an unknown id waiting where another tenant's is found at once would
tell the two apart. The hold costs a create one Redis round trip on its first bytes.

Redis slower than `wait_s` (WRITE_WAIT_S: a new connection's connect and answer timeouts): the
bytes go on, the write with them, and a follow-up at another replica before it lands is a 404.
Redis failing (its last command here failed): the bytes are not held, the write is still sent;
the other replicas' lookups in the same Redis fail too, and there an unknown id and another
tenant's are both a 503, never a 404 (gateway/responses.py), so an outage costs one create the
wait, not each one.
"""

import asyncio

import hashlib
import hmac
import json
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.response_ids import Owner
from workers.background import background
from workers.kv import redis_schema as rs
from workers.strict_json import peer_object

log = logging.getLogger("kvgate.gateway")

REDIS_TIMEOUT_S = 0.25
WRITE_WAIT_S = 2 * REDIS_TIMEOUT_S
MAX_RECORD_BYTES = 1024
MAX_FIELD_CHARS = 256  # a worker id or a tenant in a record


class LookupFailed(Exception):
    """Redis did not answer a lookup: whether the id is known elsewhere cannot be said."""


class SharedResponseIds:
    """The ledger's entries in Redis at `url`, signed with `token`."""

    def __init__(self, url: str, token: str, wait_s: float = WRITE_WAIT_S):
        if not token:
            raise ValueError("the shared response ledger needs the fleet's internal token to sign its records")
        self.url, self.token, self.wait_s = url, token, wait_s
        self.redis: aioredis.Redis | None = None
        self.failing = False
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

    def put(self, response_id: str, owner: Owner, ttl_s: float) -> "asyncio.Future[None] | None":
        """Write the entry for `ttl_s` in the background (the caller is relaying an answer);
        returns what the relay holds the id's bytes on: done once Redis has answered the write
        (or failed it), at most `wait_s` later, the write going on; None while Redis is failing."""
        write = background(self._put(response_id, owner, ttl_s))
        return None if self.failing else background(self._answered_within(write))

    async def _answered_within(self, write: "asyncio.Future[None]") -> None:
        await asyncio.wait({write}, timeout=self.wait_s)

    async def _put(self, response_id: str, owner: Owner, ttl_s: float) -> None:
        record = {
            "worker": owner.worker_id,
            "tenant": owner.tenant,
            "replayable": owner.replayable,
            "sig": self.sign(response_id, owner),
        }
        try:
            await self.client().set(rs.response_key(response_id), json.dumps(record), px=max(1, int(ttl_s * 1000)))
            self._answered()
        except (RedisError, OSError) as e:
            self._failed(e)

    async def find(self, response_id: str) -> tuple[Owner, float] | None:
        """The entry Redis holds for `response_id` and the seconds it has left, or None (absent,
        expired, or a record that is not one this fleet signed). Raises LookupFailed when Redis
        does not answer."""
        try:
            async with self.client().pipeline(transaction=False) as p:
                p.get(rs.response_key(response_id))
                p.pttl(rs.response_key(response_id))
                raw, ttl_ms = await p.execute()
            self._answered()
        except (RedisError, OSError) as e:
            self._failed(e)
            raise LookupFailed(f"redis did not answer: {type(e).__name__}") from None
        if raw is None or not isinstance(ttl_ms, int) or ttl_ms <= 0:
            return None
        owner = self.parse(response_id, raw)
        return None if owner is None else (owner, ttl_ms / 1000.0)

    def parse(self, response_id: str, raw: bytes) -> Owner | None:
        """A record read back, if it is well formed and this fleet's token signed it for this
        id; else None, the record counted and logged (the first and every 1000th)."""
        try:
            return self.checked(response_id, raw)
        except ValueError as e:
            self.malformed += 1
            if self.malformed == 1 or self.malformed % 1000 == 0:
                log.warning(
                    "dropped a response record read from redis (%d so far): %r: %s", self.malformed, response_id, e
                )
            return None

    def checked(self, response_id: str, raw: bytes) -> Owner:
        """The owner a record names; ValueError unless it is this fleet's record for this id."""
        d = peer_object(raw, "a response record", MAX_RECORD_BYTES)
        worker, tenant, replayable, sig = d.get("worker"), d.get("tenant"), d.get("replayable"), d.get("sig")
        if not (isinstance(worker, str) and isinstance(tenant, str) and isinstance(sig, str)):
            raise ValueError("its worker, tenant and sig are not strings")
        if not isinstance(replayable, bool):
            raise ValueError("its replayable is not a boolean")
        if not (0 < len(worker) <= MAX_FIELD_CHARS and len(tenant) <= MAX_FIELD_CHARS):
            raise ValueError("a field is empty or too long")
        owner = Owner(worker, tenant, replayable)
        if not hmac.compare_digest(sig.encode(errors="replace"), self.sign(response_id, owner).encode()):
            raise ValueError("bad signature")
        return owner

    def sign(self, response_id: str, owner: Owner) -> str:
        """HMAC-SHA256 over the id, the worker, the tenant and whether it is replayable (a record
        is valid under its own key only, and as it was written)."""
        text = json.dumps([response_id, owner.worker_id, owner.tenant, owner.replayable])
        return hmac.new(self.token.encode(), text.encode(), hashlib.sha256).hexdigest()

    def _answered(self) -> None:
        if self.failing:
            log.warning("responses: redis at %s answers again", rs.redact_url(self.url))
        self.failing = False

    def _failed(self, e: Exception) -> None:
        if not self.failing:
            log.warning(
                "responses: redis at %s failed (%r): response ids recorded meanwhile stay with this replica",
                rs.redact_url(self.url),
                e,
            )
        self.failing = True
