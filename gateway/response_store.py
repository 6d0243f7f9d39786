"""The responses the gateway stores for models of kvgate's workers: each Response object as
answered and the conversation a follow-up (`previous_response_id`) continues.

The gateway, not a worker, owns a kvgate model's Responses storage (workers only serve chat
completions), so any worker can serve a follow-up and the router sends it where its history is
cached. The store is an LRU bounded by entries (`--response-ids`), by bytes (what the records
hold: their JSON, `StoredResponse.held_bytes`; `--response-store-mb`) and by age (`--response-ttl-s`, from the response's creation): a response
past any bound is unknown (a 404), where an unbounded store would grow with every conversation.
With `--redis` every record is also written to Redis (gateway/shared_response_store.py), so a
replica that did not create a response can return or continue it.
"""

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.response_ids import DEFAULT_SIZE, DEFAULT_TTL_S, valid_id
from gateway.shared_response_store import MAX_RECORD_BYTES, SharedResponseStore
from gateway.stored_response import StoredResponse

log = logging.getLogger("kvgate.gateway")

DEFAULT_MB = 128.0


@dataclass(frozen=True)
class Entry:
    record: StoredResponse
    size: int  # what it holds (`StoredResponse.held_bytes`)
    expires: float  # clock() time


class ResponseStore:
    """Stored responses by id: at most `size` of them holding `max_bytes` (the least
    recently used go first), each for `ttl_s` after it was stored; with `shared`, the replicas'
    too. `clock` is time.monotonic unless a test steps it."""

    def __init__(
        self,
        size: int = DEFAULT_SIZE,
        ttl_s: float = DEFAULT_TTL_S,
        max_bytes: int = int(DEFAULT_MB * 2**20),
        shared: SharedResponseStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if size < 1 or not ttl_s > 0 or max_bytes < 1:
            raise ValueError("the response store needs a size and a byte bound of at least 1 and a positive TTL")
        self.size, self.ttl_s, self.max_bytes, self.shared, self.clock = size, ttl_s, max_bytes, shared, clock
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()

    def put(self, record: StoredResponse) -> bool:
        """Store `record` (and share it, in the background); False, storing nothing, when it
        alone is past the byte bound: its follow-ups will be 404s."""
        encoded = record.encoded()
        if len(encoded) > MAX_RECORD_BYTES or record.held_bytes() > self.max_bytes:
            log.warning(
                "response %s is %d bytes, past what the store takes: not stored", record.response_id, len(encoded)
            )
            return False
        self.remember(record, self.ttl_s)
        if self.shared is not None:
            self.shared.put(record.response_id, encoded, self.ttl_s)
        return True

    async def find(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The response `response_id` of `tenant`: this replica's, else (with Redis) the
        replicas'. Another tenant's here is asked of Redis as an unknown id is, so that Redis
        failing answers both alike. Raises LookupFailed (gateway/shared_response_ids.py) when
        Redis does not answer."""
        if not valid_id(response_id):
            return None
        record = self.get(response_id)
        if record is not None and record.tenant == tenant:
            return record
        if self.shared is None:
            return None
        found = await self.shared.find(response_id)
        if found is None:
            return None
        shared, ttl_s = found
        self.remember(shared, ttl_s)
        return shared if shared.tenant == tenant else None

    def get(self, response_id: str) -> StoredResponse | None:
        """This replica's record of `response_id` (of any tenant), which becomes the most recently used."""
        entry = self.entries.get(response_id)
        if entry is None:
            return None
        if self.clock() >= entry.expires:
            self.drop(response_id)
            return None
        self.entries.move_to_end(response_id)
        return entry.record

    def remember(self, record: StoredResponse, ttl_s: float) -> None:
        """Hold `record` here for `ttl_s` (at most the store's own TTL), the least recently used
        going past the bounds."""
        self.drop(record.response_id)
        size = record.held_bytes()
        self.entries[record.response_id] = Entry(record, size, self.clock() + min(ttl_s, self.ttl_s))
        self.bytes += size
        while len(self.entries) > self.size or self.bytes > self.max_bytes:
            self.drop(next(iter(self.entries)))

    def drop(self, response_id: str) -> None:
        entry = self.entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
