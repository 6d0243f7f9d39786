"""The responses the gateway stores for models of kvgate's workers: each Response object as
answered and the conversation a follow-up (`previous_response_id`) continues.

The gateway, not a worker, owns a kvgate model's Responses storage (workers only serve chat
completions), so any worker can serve a follow-up and the router sends it where its history is
cached. The store is bounded by entries (`--response-ids`), by bytes (what the records hold:
`StoredResponse.held_bytes`; `--response-store-mb`) and by age (`--response-ttl-s`, from the
response's creation): a response past any bound is unknown (a 404), where an unbounded store
would grow with every conversation. Each tenant has an LRU of its own, under a quota of entries
and bytes (`--response-store-ids-per-tenant`, `--response-store-mb-per-tenant`): a tenant past
its quota forgets its own least recently used, so no tenant's traffic evicts another's. Past a
store-wide bound the tenant holding the most (entries, or bytes) forgets its least recently
used. With `--redis` every record is also written to Redis (gateway/shared_response_store.py,
under the same quota per tenant), so a replica that did not create a response can return or
continue it. A tenant deletes a response (`DELETE /v1/responses/{id}`) here and, with Redis, at
every replica: Redis first (its record, and a mark the replicas check before serving a copy of
their own), then this replica's copy.
"""

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.response_ids import DEFAULT_SIZE, DEFAULT_TTL_S, valid_id
from gateway.shared_response_store import DEFAULT_MB, MAX_RECORD_BYTES, SharedResponseStore
from gateway.stored_response import StoredResponse

log = logging.getLogger("kvgate.gateway")


@dataclass(frozen=True)
class Entry:
    record: StoredResponse
    size: int  # what it holds (`StoredResponse.held_bytes`)
    expires: float  # clock() time


@dataclass
class Tenant:
    """One tenant's records, the least recently used first, and the bytes they hold."""

    name: str
    entries: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    bytes: int = 0


class ResponseStore:
    """Stored responses by tenant and id: at most `size` of them holding `max_bytes`, at most
    `tenant_size` and `tenant_bytes` of them a tenant's, each for `ttl_s` after it was stored;
    with `shared`, the replicas' too. `clock` is time.monotonic unless a test steps it."""

    def __init__(
        self,
        size: int = DEFAULT_SIZE,
        ttl_s: float = DEFAULT_TTL_S,
        max_bytes: int = int(DEFAULT_MB * 2**20),
        shared: SharedResponseStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        tenant_size: int | None = None,
        tenant_bytes: int | None = None,
    ):
        self.tenant_size = size if tenant_size is None else tenant_size
        self.tenant_bytes = max_bytes if tenant_bytes is None else tenant_bytes
        if min(size, max_bytes, self.tenant_size, self.tenant_bytes) < 1 or not ttl_s > 0:
            raise ValueError("the response store needs its sizes and byte bounds at least 1 and a positive TTL")
        self.size, self.ttl_s, self.max_bytes, self.shared, self.clock = size, ttl_s, max_bytes, shared, clock
        self.tenants: dict[str, Tenant] = {}
        self.count = self.bytes = 0

    def __len__(self) -> int:
        return self.count

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()

    def put(self, record: StoredResponse) -> Awaitable[None] | None:
        """Store `record` and (with Redis) share it; returns what the answer that ends the
        response holds on until Redis has it (gateway/shared_records.py), or None. A record
        alone past a byte bound is not stored: its follow-ups will be 404s."""
        encoded = record.encoded()
        if len(encoded) > MAX_RECORD_BYTES or record.held_bytes() > min(self.max_bytes, self.tenant_bytes):
            log.warning(
                "response %s is %d bytes, past what the store takes: not stored", record.response_id, len(encoded)
            )
            return None
        self.remember(record, self.ttl_s)
        return self.shared.put(record, encoded, self.ttl_s) if self.shared is not None else None

    async def find(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The response `response_id` of `tenant`: this replica's, else (with Redis) the
        replicas'. Another tenant's is looked up as an unknown id is, here (by tenant) and in
        Redis (under the tenant's key): both cost and answer alike, Redis failing too. Raises
        LookupFailed (gateway/shared_response_ids.py) when Redis does not answer."""
        if not valid_id(response_id):
            return None
        record = self.get(response_id, tenant)
        if record is not None:
            return await self.confirmed(record)
        if self.shared is None:
            return None
        found = await self.shared.find(response_id, tenant)
        if found is None:
            return None
        shared, ttl_s = found
        self.remember(shared, ttl_s)
        return shared

    async def confirmed(self, record: StoredResponse) -> StoredResponse | None:
        """`record`, this replica's copy, unless its tenant deleted it at another replica (then
        the copy goes too)."""
        if self.shared is None or not await self.shared.deleted(record.response_id, record.tenant):
            return record
        self.forget(record)
        return None

    async def delete(self, record: StoredResponse) -> None:
        """Delete `record` for its tenant: from Redis (raising LookupFailed when it does not
        answer, nothing deleted then), then here."""
        if self.shared is not None:
            await self.shared.delete(record.response_id, record.tenant, self.ttl_s)
        self.forget(record)

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """This replica's record of `response_id` for `tenant`, which becomes its most recently used."""
        t = self.tenants.get(tenant)
        entry = t.entries.get(response_id) if t is not None else None
        if t is None or entry is None:
            return None
        if self.clock() >= entry.expires:
            self.drop(t, response_id)
            return None
        t.entries.move_to_end(response_id)
        return entry.record

    def forget(self, record: StoredResponse) -> None:
        """Drop this replica's copy of `record`, if it holds one."""
        t = self.tenants.get(record.tenant)
        if t is not None:
            self.drop(t, record.response_id)

    def remember(self, record: StoredResponse, ttl_s: float) -> None:
        """Hold `record` here for `ttl_s` (at most the store's own TTL): its tenant's least
        recently used go past the tenant's quota, then the least recently used of the tenant
        holding the most past the store's bounds."""
        self.forget(record)
        t = self.tenants.get(record.tenant)
        if t is None:
            t = self.tenants[record.tenant] = Tenant(record.tenant)
        size = record.held_bytes()
        t.entries[record.response_id] = Entry(record, size, self.clock() + min(ttl_s, self.ttl_s))
        t.bytes += size
        self.count += 1
        self.bytes += size
        while len(t.entries) > self.tenant_size or t.bytes > self.tenant_bytes:
            self.drop_oldest(t)
        while self.count > self.size:
            self.drop_oldest(max(self.tenants.values(), key=lambda t: len(t.entries)))
        while self.bytes > self.max_bytes:
            self.drop_oldest(max(self.tenants.values(), key=lambda t: t.bytes))

    def drop_oldest(self, t: Tenant) -> None:
        self.drop(t, next(iter(t.entries)))

    def drop(self, t: Tenant, response_id: str) -> None:
        entry = t.entries.pop(response_id, None)
        if entry is None:
            return
        t.bytes -= entry.size
        self.count -= 1
        self.bytes -= entry.size
        if not t.entries:
            del self.tenants[t.name]
