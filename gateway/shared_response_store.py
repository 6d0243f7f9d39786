"""The responses stored for kvgate's workers, shared by gateway replicas through Redis (`--redis`).

A follow-up, retrieve or cancel may reach another replica than the one that created the
response, so each replica writes every response it stores to
`kvgate:stored-response:{tenant}:{id}` (workers/kv/redis_schema.py) with the store's TTL as
the answer goes out, the answer's end held until Redis has acknowledged it (a whole answer, or
a stream's last event: gateway/shared_records.py says why and for how long), and a replica
that does not hold an id reads it there before it calls it unknown. `{tenant}` is the tenant's tag, an HMAC of the tenant with the fleet's internal
token: a lookup reads the asking tenant's key only, so another tenant's id is the same plain
miss as an unknown one, in what it answers and in what it costs (a record fetched, checked and
parsed before its tenant was compared took longer than a miss, and told the two apart). A
record is its HMAC-SHA256 signature with the token over the id and the record's bytes, then the
record (gateway/stored_response.py): whoever can write to Redis but lacks the token can neither
hand a tenant's conversation to another tenant (a record copied under another tenant's tag
names its own tenant) nor put words in its history. The signature is checked before the record
is parsed, and the record then as every Redis record is (bounded size, strict JSON, its fields'
types); a bad one is counted and taken as absent.

**A tenant's quota holds in Redis too**, fleet-wide (`--response-store-ids-per-tenant`,
`--response-store-mb-per-tenant`): each record would otherwise stay a day
(`--response-ttl-s`), and Redis also holds the fleet's registry, residency and rate limits. A
tenant's records are indexed in `kvgate:stored-responses:{tenant}` (a sorted set of "id size"
members scored by their expiry, in ms on Redis's clock) beside the bytes they hold
(`kvgate:stored-response-bytes:{tenant}`), and one Lua script (STORE) writes a record: it drops
from the index what expired, then takes the tenant's oldest records out (index and record) until
the new one fits, then writes it; both keys expire with the tenant's last record. One script is
atomic, so replicas writing one tenant's records at once keep its count and bytes exact, and
never touch another tenant's. A counter lost alone is counted again from the index, and an empty
index restarts it at 0. The script names the records it evicts from their ids (a key it is not
given): one Redis, not a cluster, as the rest of kvgate's layout.

**A delete holds fleet-wide**: a second script (DELETE) takes the record out of Redis, its index
and its bytes, and leaves a mark (`kvgate:deleted-response:{tenant}:{id}`) as long as the record
would have lived and at least the store's TTL, the longest a replica may hold a copy of it; a
replica asks for that mark before it serves a copy of its own (`deleted`), so no replica answers
for a response once its DELETE has answered.
"""

import asyncio
import hashlib
import hmac
import logging

from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.response_ids import DEFAULT_SIZE
from gateway.shared_records import WRITE_WAIT_S, LookupFailed, SharedRecords
from gateway.stored_response import StoredResponse
from workers.kv import redis_schema as rs
from workers.strict_json import peer_object

log = logging.getLogger("kvgate.gateway")

DEFAULT_MB = 128.0  # the store's bound, and a tenant's without API keys
MAX_RECORD_BYTES = 16 << 20  # a conversation of a long context is some MiB of text at most
SIG_BYTES = 64  # hex digits of the HMAC-SHA256
TAG_CHARS = 32  # hex digits of a tenant's tag: 128 bits

# Redis's clock in ms, which both scripts score the index by
NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: the record, the tenant's index, its bytes, the record's deleted mark. ARGV: the record's
# value, its TTL (ms), the tenant's quota of records and of bytes, its records' key prefix, the
# record's id, its marks' key prefix. Returns the records evicted, -1 (nothing written) for a
# record alone past the bytes, -2 (nothing written) for one deleted already (its write late).
# A member of the index is "id size" for a record, "~id 0" for a deleted mark (its own entry
# of the quota: a tenant cannot make Redis hold more marks than its quota of responses).
STORE = (
    NOW
    + """
local value, ttl, most, most_bytes = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local size = string.len(value)
if size > most_bytes then return -1 end
if redis.call('EXISTS', KEYS[4]) == 1 then return -2 end
local function size_of(member) return tonumber(string.match(member, ' (%d+)$')) end
local total = tonumber(redis.call('GET', KEYS[3]))
if total == nil then
  total = 0
  for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do total = total + size_of(m) end
end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do total = total - size_of(m) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local count = redis.call('ZCARD', KEYS[2])
if count == 0 then total = 0 end
local evicted = 0
while count > 0 and (count >= most or total + size > most_bytes) do
  local m = redis.call('ZPOPMIN', KEYS[2])[1]
  total = total - size_of(m)
  local id = string.match(m, '^(%S+) ')
  if string.sub(id, 1, 1) == '~' then
    redis.call('DEL', ARGV[7] .. string.sub(id, 2))
  else
    redis.call('DEL', ARGV[5] .. id)
  end
  count, evicted = count - 1, evicted + 1
end
redis.call('SET', KEYS[1], value, 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[6] .. ' ' .. size)
local last = math.floor(tonumber(redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2]))
redis.call('SET', KEYS[3], total + size)
redis.call('PEXPIREAT', KEYS[3], last)
redis.call('PEXPIREAT', KEYS[2], last)
return evicted
"""
)


# KEYS: the record, the tenant's index, its bytes, the deleted mark. ARGV: the record's id, the
# mark's least TTL (ms: the deleting replica's store TTL). The mark lives as long as the record
# would have, at least that TTL, in the index as "~id 0". Returns 1 when Redis held the record,
# else 0 (the mark is set either way: replicas may hold copies of a record Redis evicted).
DELETE = (
    NOW
    + """
local ttl = math.max(tonumber(ARGV[2]), redis.call('PTTL', KEYS[1]))
redis.call('SET', KEYS[4], '1', 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, '~' .. ARGV[1] .. ' 0')
local held = 0
local value = redis.call('GET', KEYS[1])
if value then
  local size = string.len(value)
  if redis.call('ZREM', KEYS[2], ARGV[1] .. ' ' .. size) == 1 and redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('DECRBY', KEYS[3], size)
  end
  redis.call('DEL', KEYS[1])
  held = 1
end
local last = math.floor(tonumber(redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2]))
redis.call('PEXPIREAT', KEYS[2], last)
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('PEXPIREAT', KEYS[3], last) end
return held
"""
)


class SharedResponseStore(SharedRecords):
    """The stored responses in Redis at `url`, signed with `token`, at most `tenant_size` of a
    tenant's holding `tenant_bytes` (their records' bytes in Redis)."""

    def __init__(
        self,
        url: str,
        token: str,
        tenant_size: int = DEFAULT_SIZE,
        tenant_bytes: int = int(DEFAULT_MB * 2**20),
        wait_s: float = WRITE_WAIT_S,
    ):
        super().__init__(url, token, "stored responses", "responses stored", wait_s)
        if min(tenant_size, tenant_bytes) < 1:
            raise ValueError("a tenant's quota is at least one response and one byte")
        self.tenant_size, self.tenant_bytes = tenant_size, tenant_bytes
        self.script: AsyncScript | None = None
        self.delete_script: AsyncScript | None = None

    def tenant_tag(self, tenant: str) -> str:
        """The tenant's name in its records' keys: an HMAC with the fleet's token, so the keys
        name no tenant and no one without the token can tell whose a key is."""
        text = b"tenant\n" + tenant.encode("utf-8", "surrogatepass")
        return hmac.new(self.token.encode(), text, hashlib.sha256).hexdigest()[:TAG_CHARS]

    def put(self, record: StoredResponse, encoded: bytes, ttl_s: float) -> "asyncio.Future[None] | None":
        """Write `record` (`encoded`: its JSON) for `ttl_s` within its tenant's quota (STORE),
        in the background; returns what the answer that ends the response holds on
        (`SharedRecords.held`)."""
        return self.held(self._put(record, self.sign(record.response_id, encoded) + encoded, ttl_s))

    async def _put(self, record: StoredResponse, value: bytes, ttl_s: float) -> None:
        tag = self.tenant_tag(record.tenant)
        keys = [
            rs.stored_response_key(tag, record.response_id),
            rs.stored_responses_key(tag),
            rs.stored_response_bytes_key(tag),
            rs.deleted_response_key(tag, record.response_id),
        ]
        args: list[bytes | str | int] = [
            value,
            max(1, int(ttl_s * 1000)),
            self.tenant_size,
            self.tenant_bytes,
            rs.stored_response_key(tag, ""),
            record.response_id,
            rs.deleted_response_key(tag, ""),
        ]
        try:
            if self.script is None:
                self.script = self.client().register_script(STORE)
            evicted = await self.script(keys=keys, args=args)
            self.answered()
        except (RedisError, OSError) as e:
            self.failed(e)
            return
        if evicted == -1:
            log.warning("response %s is past its tenant's quota alone: not stored in redis", record.response_id)
        elif evicted == -2:
            log.info("response %s was deleted before its record reached redis: not stored", record.response_id)

    async def delete(self, response_id: str, tenant: str, ttl_s: float) -> None:
        """Take `tenant`'s `response_id` out of Redis and mark it deleted, for at least `ttl_s`
        (DELETE). Raises LookupFailed when Redis does not answer and the mark cannot be seen
        either: the response may still be served (a script whose answer timed out may have run:
        its mark says so, and the delete stands)."""
        tag = self.tenant_tag(tenant)
        keys = [
            rs.stored_response_key(tag, response_id),
            rs.stored_responses_key(tag),
            rs.stored_response_bytes_key(tag),
            rs.deleted_response_key(tag, response_id),
        ]
        try:
            if self.delete_script is None:
                self.delete_script = self.client().register_script(DELETE)
            await self.delete_script(keys=keys, args=[response_id, max(1, int(ttl_s * 1000))])
            self.answered()
        except (RedisError, OSError) as e:
            self.failed(e)
            if not await self.marked(keys[3]):
                raise LookupFailed(f"redis did not answer: {type(e).__name__}") from None

    async def deleted(self, response_id: str, tenant: str) -> bool:
        """Whether `tenant`'s `response_id` was deleted (at any replica); False when Redis does not
        answer, and without asking while it has just failed (`backing_off`): a replica's own copy
        is then served, as every lookup it can answer alone is, without waiting on Redis."""
        if self.backing_off():
            return False
        return await self.marked(rs.deleted_response_key(self.tenant_tag(tenant), response_id))

    async def marked(self, key: str) -> bool:
        """Whether the deleted mark `key` is set; False when Redis does not answer."""
        try:
            marked = await self.client().exists(key)
            self.answered()
        except (RedisError, OSError) as e:
            self.failed(e)
            return False
        return bool(marked)

    async def find(self, response_id: str, tenant: str) -> tuple[StoredResponse, float] | None:
        """The record Redis holds for `response_id` of `tenant` and the seconds it has left, or
        None (absent, another tenant's, expired, or not one this fleet signed). Raises
        LookupFailed when Redis does not answer."""
        tag = self.tenant_tag(tenant)
        found = await self.read(rs.stored_response_key(tag, response_id), rs.deleted_response_key(tag, response_id))
        if found is None:
            return None
        record = self.parse(response_id, tenant, found[0])
        return None if record is None else (record, found[1])

    def parse(self, response_id: str, tenant: str, raw: bytes) -> StoredResponse | None:
        """A record read back under `tenant`'s key if this fleet's token signed it for this id,
        it is well formed and `tenant`'s; else None, the record counted and logged (the first
        and every 1000th)."""
        return self.parsed(response_id, lambda: self.checked(response_id, tenant, raw))

    def checked(self, response_id: str, tenant: str, raw: bytes) -> StoredResponse:
        if len(raw) > SIG_BYTES + MAX_RECORD_BYTES:
            raise ValueError(f"over {MAX_RECORD_BYTES} bytes")
        sig, encoded = raw[:SIG_BYTES], raw[SIG_BYTES:]
        if not hmac.compare_digest(sig, self.sign(response_id, encoded)):
            raise ValueError("bad signature")
        record = StoredResponse.from_json(peer_object(encoded, "a stored response", MAX_RECORD_BYTES))
        if record.response_id != response_id:
            raise ValueError("a record of another id")
        if record.tenant != tenant:
            raise ValueError("a record of another tenant, under this one's key")
        return record

    def sign(self, response_id: str, encoded: bytes) -> bytes:
        """HMAC-SHA256 over the id and the record (valid under its own key only, and as written)."""
        return (
            hmac.new(self.token.encode(), response_id.encode() + b"\n" + encoded, hashlib.sha256).hexdigest().encode()
        )
