"""The Redis layout of residency, registry and shared load: a contract like the event schema.

Workers write it (workers/redis_publisher.py), gateway replicas read it (gateway/redis_state.py);
both take the key names and the stream-entry encoding from here. A pool is the workers of one
served model: their block hashes share a seed, so their residency is comparable.

  kvgate:pools                     set of pool names
  kvgate:{pool}:workers            set of worker ids that registered in the pool
  kvgate:{pool}:hb:{worker}        heartbeat JSON {worker_id, url, pool, state}, expires (TTL)
  kvgate:{pool}:res:{worker}       set of the worker's resident block hashes (decimal)
  kvgate:{pool}:seq:{worker}       the event seq the set is current to
  kvgate:{pool}:events             stream of KV events, fields w s k h p (see encode_event)
  kvgate:replicas                  set of gateway replica ids
  kvgate:inflight:{replica}        hash worker id -> requests that replica has open, expires
"""
from workers.kv.events import KVEvent

PREFIX = "kvgate"
POOLS = f"{PREFIX}:pools"
REPLICAS = f"{PREFIX}:replicas"
SNAPSHOT = "snapshot"
STREAM_MAXLEN = 200_000


def workers_key(pool: str) -> str:
    return f"{PREFIX}:{pool}:workers"


def heartbeat_key(pool: str, worker_id: str) -> str:
    return f"{PREFIX}:{pool}:hb:{worker_id}"


def resident_key(pool: str, worker_id: str) -> str:
    return f"{PREFIX}:{pool}:res:{worker_id}"


def seq_key(pool: str, worker_id: str) -> str:
    return f"{PREFIX}:{pool}:seq:{worker_id}"


def stream_key(pool: str) -> str:
    return f"{PREFIX}:{pool}:events"


def inflight_key(replica: str) -> str:
    return f"{PREFIX}:inflight:{replica}"


def encode_event(worker_id: str, ev: KVEvent) -> dict[str, str]:
    """A stream entry. Kind `snapshot` (no hashes) says the worker rewrote its set as of `s`."""
    return {"w": worker_id, "s": str(ev.seq), "k": ev.kind, "h": " ".join(map(str, ev.hashes)),
            "p": "" if ev.parent is None else str(ev.parent)}


def decode_event(fields: dict[bytes, bytes]) -> tuple[str, KVEvent]:
    parent = fields.get(b"p", b"")
    return fields[b"w"].decode(), KVEvent(int(fields[b"s"]), fields[b"k"].decode(),
                                          tuple(map(int, fields.get(b"h", b"").split())),
                                          int(parent) if parent else None)
