"""Which worker holds a stored response: the gateway's ledger of Responses API ids.

A vLLM server keeps a stored response (`store`, its default) in its own memory, so a follow-up
(`previous_response_id`), a retrieve and a cancel can only be served by the server that made it
(gateway/responses.py). The gateway learns each id from the answer that carries it and records
here the worker and the tenant that made it. The ids come from workers but clients echo them
back, so an id is bounded (`valid_id`) before it is recorded or looked up, and the ledger is an
LRU of at most `size` entries that forgets an entry `ttl_s` after it was recorded: a response
older than that, or pushed out by newer ones, is unknown to the gateway (a 404), where an
unbounded table would grow with every response the fleet ever made.
"""

import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_ID_CHARS = 128  # vLLM's ids are `resp_` and 16 hex digits, OpenAI's about 50 characters
_ID = re.compile(r"[A-Za-z0-9_.:-]+")  # what an id recorded here may hold: safe in a URL path and a Redis key
DEFAULT_SIZE = 100_000
DEFAULT_TTL_S = 86_400.0


def valid_id(response_id: str) -> bool:
    """Whether `response_id` can be a recorded id: 1 to MAX_ID_CHARS of letters, digits and
    `_.:-` (a worker's id outside that is not recorded; a client's is unknown)."""
    return len(response_id) <= MAX_ID_CHARS and _ID.fullmatch(response_id) is not None


@dataclass(frozen=True)
class Owner:
    """Who holds a response and whose it is: the worker that stored it and the tenant whose key
    made it ("" when the gateway has no API keys); and whether its events can be streamed again
    (`GET ...?stream=true`): only where it was created with both `background` and `stream`, the
    one case vLLM keeps a response's events (any other it starts to answer, then breaks off)."""

    worker_id: str
    tenant: str
    replayable: bool = False


@dataclass(frozen=True)
class Entry:
    owner: Owner
    expires: float  # clock() time


class ResponseIds:
    """response id -> `Owner`, at most `size` of them (the least recently used go first), each
    for `ttl_s` after it was recorded. `clock` is time.monotonic unless a test steps it."""

    def __init__(
        self, size: int = DEFAULT_SIZE, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic
    ):
        if size < 1 or not ttl_s > 0:
            raise ValueError("the response ledger needs a size of at least 1 and a positive TTL")
        self.size, self.ttl_s, self.clock = size, ttl_s, clock
        self.entries: OrderedDict[str, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def record(self, response_id: str, owner: Owner, ttl_s: float | None = None) -> bool:
        """Remember `owner` for `response_id` for `ttl_s` (at most the ledger's own TTL); False,
        recording nothing, for an id `valid_id` refuses."""
        if not valid_id(response_id):
            return False
        ttl = self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s)
        self.entries[response_id] = Entry(owner, self.clock() + ttl)
        self.entries.move_to_end(response_id)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return True

    def find(self, response_id: str) -> Owner | None:
        """The owner recorded for `response_id`, or None (never recorded, expired, or pushed out);
        a found entry becomes the most recently used."""
        entry = self.entries.get(response_id)
        if entry is None:
            return None
        if self.clock() >= entry.expires:
            del self.entries[response_id]
            return None
        self.entries.move_to_end(response_id)
        return entry.owner
