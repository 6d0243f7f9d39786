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

**The id reaches the client only once its record is in Redis**: the relay holds the bytes that
complete the id until Redis has acknowledged the write (`put`; gateway/response_tap.py,
gateway/shared_records.py, which says why and for how long). The hold costs a create one Redis
round trip on its first bytes.
"""

import asyncio
import hashlib
import hmac
import json

from redis.exceptions import RedisError

from gateway.response_ids import Owner
from gateway.shared_records import WRITE_WAIT_S, SharedRecords
from workers.kv import redis_schema as rs
from workers.strict_json import peer_object

MAX_RECORD_BYTES = 1024
MAX_FIELD_CHARS = 256  # a worker id or a tenant in a record


class SharedResponseIds(SharedRecords):
    """The ledger's entries in Redis at `url`, signed with `token`."""

    def __init__(self, url: str, token: str, wait_s: float = WRITE_WAIT_S):
        super().__init__(url, token, "responses", "response ids recorded", wait_s)

    def put(self, response_id: str, owner: Owner, ttl_s: float) -> "asyncio.Future[None] | None":
        """Write the entry for `ttl_s` in the background (the caller is relaying an answer);
        returns what the relay holds the id's bytes on (`SharedRecords.held`)."""
        return self.held(self._put(response_id, owner, ttl_s))

    async def _put(self, response_id: str, owner: Owner, ttl_s: float) -> None:
        record = {
            "worker": owner.worker_id,
            "tenant": owner.tenant,
            "replayable": owner.replayable,
            "sig": self.sign(response_id, owner),
        }
        try:
            await self.client().set(rs.response_key(response_id), json.dumps(record), px=max(1, int(ttl_s * 1000)))
            self.answered()
        except (RedisError, OSError) as e:
            self.failed(e)

    async def find(self, response_id: str) -> tuple[Owner, float] | None:
        """The entry Redis holds for `response_id` and the seconds it has left, or None (absent,
        expired, or a record that is not one this fleet signed). Raises LookupFailed when Redis
        does not answer."""
        found = await self.read(rs.response_key(response_id))
        if found is None:
            return None
        owner = self.parse(response_id, found[0])
        return None if owner is None else (owner, found[1])

    def parse(self, response_id: str, raw: bytes) -> Owner | None:
        """A record read back, if it is well formed and this fleet's token signed it for this
        id; else None, the record counted and logged (the first and every 1000th)."""
        return self.parsed(response_id, lambda: self.checked(response_id, raw))

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
