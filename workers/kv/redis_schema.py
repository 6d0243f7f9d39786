"""The Redis layout of residency, registry and shared load: a contract like the event schema.

Workers write it (workers/redis_publisher.py), gateway replicas read it (gateway/redis_state.py);
both take the key names and the stream-entry encoding from here. A pool is the workers of one
served model: their block hashes share a seed, so their residency is comparable.

  kvgate:pools                     set of pool names
  kvgate:{pool}:workers            set of worker ids that registered in the pool
  kvgate:{pool}:hb:{worker}        heartbeat JSON (a signed Registration), expires (TTL)
  kvgate:{pool}:res:{worker}       set of the worker's resident block hashes (decimal)
  kvgate:{pool}:res-host:{worker}  the same for its host tier (res-disk: its disk tier)
  kvgate:{pool}:seq:{worker}       the event seq the set is current to
  kvgate:{pool}:events             stream of KV events, an entry per flush of one worker: fields
                                   w (the worker) and e (a line per event; see encode_events)
  kvgate:{pool}:nixl:{agent}       a worker's NIXL agent metadata and cache layout (a signed
                                   AgentRecord), expires (the heartbeat's TTL), by agent name
  kvgate:replicas                  set of gateway replica ids
  kvgate:inflight:{replica}        hash worker id -> requests that replica has open, expires
  kvgate:share (pub/sub)           what a replica shares, a line each: "replica seq worker delta"
                                   (in-flight, one per routing decision or end) or a JSON note
                                   of its ledger (gateway/shared_ledger.py); a message holds
                                   what one flush of the replica's outbox had queued
  kvgate:ratelimit:{key}:{limit}   a gateway API key's token bucket {tokens, ts}, expires
  kvgate:response:{id}             a stored Responses API response's worker and tenant (a signed
                                   JSON record, gateway/shared_response_ids.py), expires
  kvgate:stored-response:{tenant}:{id}
                                   a Responses API response the gateway stored for kvgate's
                                   workers (its signature, then its JSON record:
                                   gateway/shared_response_store.py), expires; {tenant} is
                                   the tenant's tag, a keyed hash of it
  kvgate:stored-responses:{tenant} a tenant's stored responses, "id size" members scored by
                                   their expiry (ms), and kvgate:stored-response-bytes:{tenant}
                                   their bytes: its quota (gateway/shared_response_store.py)

A registration is signed with the fleet's internal token (HMAC-SHA256 over its canonical JSON):
whoever can write to Redis but lacks the token cannot point gateways at a server of theirs. An
AgentRecord is signed the same way: nor can they make a prefill worker WRITE into their memory.
"""

import hashlib
import hmac
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from urllib.parse import urlsplit, urlunsplit

from workers.kv.events import (
    CLEARED,
    DEVICE,
    MAX_HASH,
    MAX_SEQ,
    MEDIA,
    REMOVED,
    STORED,
    KVEvent,
    checked_hashes,
    checked_number,
)

PREFIX = "kvgate"
POOLS = f"{PREFIX}:pools"
REPLICAS = f"{PREFIX}:replicas"
SHARE_CHANNEL = f"{PREFIX}:share"  # pub/sub: in-flight deltas and ledger notes, a line each
MAX_SHARE_BYTES = 1 << 18  # a flush's lines go out in messages of about this size at most
SEQ_FIELD = "__seq"  # in a replica's in-flight table: the last delta it had published when written
SNAPSHOT = "snapshot"
STREAM_MAXLEN = 200_000


def workers_key(pool: str) -> str:
    return f"{PREFIX}:{pool}:workers"


def heartbeat_key(pool: str, worker_id: str) -> str:
    return f"{PREFIX}:{pool}:hb:{worker_id}"


def resident_key(pool: str, worker_id: str, medium: str = DEVICE) -> str:
    """The set of a worker's hashes in one tier: `res` for the device, `res-host`, `res-disk`."""
    return f"{PREFIX}:{pool}:res:{worker_id}" if medium == DEVICE else f"{PREFIX}:{pool}:res-{medium}:{worker_id}"


def resident_keys(pool: str, worker_id: str) -> list[str]:
    """Every tier's set of a worker, device first (in MEDIA order)."""
    return [resident_key(pool, worker_id, m) for m in MEDIA]


def seq_key(pool: str, worker_id: str) -> str:
    return f"{PREFIX}:{pool}:seq:{worker_id}"


def stream_key(pool: str) -> str:
    return f"{PREFIX}:{pool}:events"


def nixl_key(pool: str, agent: str) -> str:
    """A NIXL agent's record: by agent name, which is new at each start of a worker."""
    return f"{PREFIX}:{pool}:nixl:{agent}"


def inflight_key(replica: str) -> str:
    return f"{PREFIX}:inflight:{replica}"


KINDS = (STORED, REMOVED, CLEARED, SNAPSHOT)


def encode_events(worker_id: str, events: Sequence[KVEvent]) -> dict[str, str]:
    """One stream entry for the events of one flush, in seq order: `w` the worker, `e` a line
    per event, `seq kind medium parent hash...` (parent `-` for none). Kind `snapshot` (no
    hashes) says the worker rewrote its sets as of its seq. An entry a flush, not an event:
    every gateway replica reads every entry, and redis-py's parsing of an entry cost a replica
    several times what applying its event did."""
    lines = (
        f"{ev.seq} {ev.kind} {ev.medium} {'-' if ev.parent is None else ev.parent} {' '.join(map(str, ev.hashes))}"
        for ev in events
    )
    return {"w": worker_id, "e": "\n".join(lines)}


def decode_events(fields: dict[bytes, bytes]) -> tuple[str, list[KVEvent]]:
    """The worker and events of a stream entry; an entry without `e` is one event as workers
    wrote it before entries were batched (fields s k h p [m]), so gateways can be upgraded
    first. Raises ValueError for anything else: Redis's writers are not trusted to be well-formed."""
    try:
        wid = fields[b"w"].decode()
        if b"e" not in fields:
            old = [fields[b"s"], fields[b"k"], fields.get(b"m") or DEVICE.encode(), fields.get(b"p") or b"-"]
            return wid, [_event([*old, *fields.get(b"h", b"").split()])]
        return wid, [_event(line.split()) for line in fields[b"e"].split(b"\n")]
    except (KeyError, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"not a KV event entry: {e!r}") from None


def _event(parts: list[bytes]) -> KVEvent:
    """One event's line `seq kind medium parent|- hash...`, its numbers by the events' one rule
    (`checked_number`)."""
    kind, medium = parts[1].decode(), parts[2].decode()
    if kind not in KINDS or medium not in MEDIA:
        raise ValueError(f"not a KV event: kind {kind!r}, medium {medium!r}")
    parent = None if parts[3] == b"-" else checked_number(int(parts[3]), MAX_HASH, "a KV event's parent")
    seq = checked_number(int(parts[0]), MAX_SEQ, "a KV event's seq")
    hashes = checked_hashes([int(h) for h in parts[4:]], "a KV event's hashes")
    return KVEvent(seq, kind, hashes, parent, medium=medium)


def ratelimit_key(key_name: str, limit: str) -> str:
    return f"{PREFIX}:ratelimit:{key_name}:{limit}"


def response_key(response_id: str) -> str:
    """Where gateway replicas share which worker holds a stored response (its id bounded and
    of safe characters: gateway/response_ids.py `valid_id`)."""
    return f"{PREFIX}:response:{response_id}"


def stored_response_key(tenant_tag: str, response_id: str) -> str:
    """Where gateway replicas share a response the gateway stored for kvgate's workers: under
    its tenant's tag (a keyed hash of the tenant: gateway/shared_response_store.py), its id
    bounded and of safe characters, as `response_key`'s."""
    return f"{PREFIX}:stored-response:{tenant_tag}:{response_id}"


def stored_responses_key(tenant_tag: str) -> str:
    """A tenant's stored responses for kvgate's workers: a sorted set of "id size" members
    scored by their expiry (ms), which its quota in Redis is kept by."""
    return f"{PREFIX}:stored-responses:{tenant_tag}"


def deleted_response_key(tenant_tag: str, response_id: str) -> str:
    """A stored response its tenant deleted, for as long as a replica may still hold a copy of
    it (the store's TTL): a replica checks it before it serves its own copy."""
    return f"{PREFIX}:deleted-response:{tenant_tag}:{response_id}"


def stored_response_bytes_key(tenant_tag: str) -> str:
    """The bytes a tenant's stored responses hold in Redis (`stored_responses_key`'s sizes summed)."""
    return f"{PREFIX}:stored-response-bytes:{tenant_tag}"


MAX_REGISTRATION_AGE_S = 60.0


@dataclass(frozen=True)
class Registration:
    """A worker's heartbeat: where to reach it and in which pool, signed by a token holder."""

    worker_id: str
    url: str
    pool: str
    ts: float
    state: dict = field(default_factory=dict)
    sig: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Registration":
        """Raises ValueError for a body that is not a registration."""
        if not isinstance(d, dict):
            raise ValueError("a registration is a JSON object")
        try:
            reg = cls(d["worker_id"], d["url"], d["pool"], float(d["ts"]), d.get("state", {}), d.get("sig", ""))
        except (KeyError, TypeError, OverflowError) as e:
            raise ValueError(f"not a registration: {e!r}") from None
        if not all(isinstance(v, str) for v in (reg.worker_id, reg.url, reg.pool, reg.sig)) or not isinstance(
            reg.state, dict
        ):
            raise ValueError("a registration's worker_id, url, pool and sig are strings, its state an object")
        return reg

    def signed(self, token: str) -> "Registration":
        return replace(self, sig=_mac(token, replace(self, sig="").to_json()))

    def why_invalid(self, token: str, now: float | None = None) -> str | None:
        """None when `token` signed it recently; else why not (a replayed old heartbeat is stale)."""
        if not self.sig:
            return "unsigned"
        if not _sig_matches(self.sig, token, replace(self, sig="").to_json()):
            return "bad signature"
        if not abs((time.time() if now is None else now) - self.ts) <= MAX_REGISTRATION_AGE_S:
            return "stale"
        return None


@dataclass(frozen=True)
class AgentRecord:
    """A worker's NIXL agent: its name and the cache layout a peer WRITEs by (CacheLayout's JSON,
    the agent's metadata in it), signed by a token holder. It needs no timestamp: an agent name is
    new at each start and its metadata never changes, so a replayed record is still the truth."""

    worker_id: str
    agent: str
    layout: dict
    sig: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "AgentRecord":
        """Raises ValueError for a body that is not an agent record."""
        if not isinstance(d, dict):
            raise ValueError("an agent record is a JSON object")
        try:
            rec = cls(d["worker_id"], d["agent"], d["layout"], d.get("sig", ""))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not an agent record: {e!r}") from None
        if not all(isinstance(v, str) for v in (rec.worker_id, rec.agent, rec.sig)) or not isinstance(rec.layout, dict):
            raise ValueError("an agent record's worker_id, agent and sig are strings, its layout an object")
        return rec

    def signed(self, token: str) -> "AgentRecord":
        return replace(self, sig=_mac(token, replace(self, sig="").to_json()))

    def why_invalid(self, token: str) -> str | None:
        """None when `token` signed it and its layout is its own agent's; else why not."""
        if not self.sig:
            return "unsigned"
        if not _sig_matches(self.sig, token, replace(self, sig="").to_json()):
            return "bad signature"
        if self.layout.get("agent") != self.agent:
            return "the layout is another agent's"
        return None


def _mac(token: str, body: dict) -> str:
    """HMAC-SHA256 over the canonical JSON of `body`."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hmac.new(token.encode(), text.encode(), hashlib.sha256).hexdigest()


def _sig_matches(sig: str, token: str, body: dict) -> bool:
    return hmac.compare_digest(sig.encode(errors="replace"), _mac(token, body).encode())


@dataclass
class Backoff:
    """The wait before reconnecting to Redis, for the workers' publisher and the gateways alike:
    `first` seconds after a failure, doubling while it keeps failing up to `longest`; `reset`
    once connected. Short at first so a blip costs little, capped so a long outage is still
    noticed soon after it ends."""

    first: float = 0.2
    longest: float = 5.0
    current: float = field(init=False)

    def __post_init__(self) -> None:
        self.current = self.first

    def reset(self) -> None:
        self.current = self.first

    def next(self) -> float:
        """The wait now, and double it for the next failure."""
        wait, self.current = self.current, min(self.current * 2, self.longest)
        return wait


def redact_url(url: str) -> str:
    """A Redis URL fit for logs: its password (and user) replaced by `***`."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
