"""KV events: the schema every worker publishes and every consumer (gateway, Redis) reads.

Events are numbered 1, 2, 3... per worker with no gaps. A consumer that sees a gap (its
next expected seq is older than what the log still holds) resynchronises from a snapshot.
What comes off the wire (`from_json`, and Redis's stream entries through
`workers.kv.redis_schema`) is another process's: every field is checked, one rule for the
numbers (`checked_number`: seqs from 0 to 2**63 - 1, block hashes 64-bit unsigned as
`workers.kv.hashing` makes them), and a body that is not what it claims raises ValueError
before any of it is used.
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from threading import Lock

from workers.kv.hashing import MASK64

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"
KINDS = (STORED, REMOVED, CLEARED)

# Where a stored/removed block lives (vLLM's KV events carry the same `medium`). An event
# without one (an older worker) means device memory.
DEVICE, HOST, DISK = "device", "host", "disk"
MEDIA = (DEVICE, HOST, DISK)

MAX_SEQ = (1 << 63) - 1
MAX_HASH = MASK64  # block hashes are what workers.kv.hashing makes


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: str
    hashes: tuple[int, ...] = ()
    parent: int | None = None
    ts: float = field(default_factory=time.time)
    medium: str = DEVICE

    def to_json(self) -> dict:
        d = asdict(self)
        d["hashes"] = list(self.hashes)
        return d

    @staticmethod
    def from_json(d: dict) -> "KVEvent":
        """Raises ValueError for anything but an event of a known kind and medium, with integer
        seq, hashes and parent: a batch is checked whole before any of it is applied."""
        if type(d) is not dict:
            raise ValueError(f"a KV event is a JSON object, not {shown(d)}")
        kind, medium, parent, ts = d.get("kind"), d.get("medium") or DEVICE, d.get("parent"), d.get("ts", 0.0)
        if kind not in KINDS or medium not in MEDIA:
            raise ValueError(f"a KV event of kind {shown(kind)} and medium {shown(medium)}")
        if parent is not None:
            checked_number(parent, MAX_HASH, "a KV event's parent")
        if type(ts) is not float and type(ts) is not int:
            raise ValueError(f"a KV event's ts must be a number, not {shown(ts)}")
        return KVEvent(
            checked_number(d.get("seq"), MAX_SEQ, "a KV event's seq"),
            kind,
            checked_hashes(d.get("hashes", ()), "a KV event's hashes"),
            parent,
            ts,
            medium,
        )


@dataclass
class KVSnapshot:
    """A worker's residency as of event `seq`: device hashes, and the slower tiers' by medium
    (GET /kv/snapshot; a body without `tiers` is an older worker's: device only)."""

    worker_id: str
    seq: int
    hashes: list[int]
    tiers: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "KVSnapshot":
        """Raises ValueError for a body that is not a snapshot (a worker is not trusted to send one);
        tiers of an unknown medium are left out."""
        if type(d) is not dict:
            raise ValueError(f"a KV snapshot is a JSON object, not {shown(d)}")
        tiers = d.get("tiers") or {}
        if type(tiers) is not dict:
            raise ValueError(f"a KV snapshot's tiers must be an object, not {shown(tiers)}")
        return KVSnapshot(
            _str(d.get("worker_id"), "a KV snapshot's worker_id"),
            checked_number(d.get("seq"), MAX_SEQ, "a KV snapshot's seq"),
            list(checked_hashes(d.get("hashes"), "a KV snapshot's hashes")),
            {
                m: list(checked_hashes(hs, f"a KV snapshot's {m} tier"))
                for m, hs in tiers.items()
                if m in MEDIA and m != DEVICE
            },
        )


@dataclass
class EventBatch:
    """What `/kv/events` returns: events after a seq, or `gap=True` when they are gone."""

    worker_id: str
    events: list[KVEvent]
    last_seq: int
    gap: bool = False

    def to_json(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "last_seq": self.last_seq,
            "gap": self.gap,
            "events": [e.to_json() for e in self.events],
        }

    @staticmethod
    def from_json(d: dict) -> "EventBatch":
        """Raises ValueError for a body that is not a batch, one of its events included
        (`KVEvent.from_json`): nothing of a malformed batch is applied."""
        if type(d) is not dict:
            raise ValueError(f"a KV-event batch is a JSON object, not {shown(d)}")
        events, gap = d.get("events"), d.get("gap", False)
        if type(events) is not list or type(gap) is not bool:
            raise ValueError(
                f"a KV-event batch's events must be a list and gap a bool, not {shown(events)}, {shown(gap)}"
            )
        return EventBatch(
            _str(d.get("worker_id"), "a KV-event batch's worker_id"),
            [KVEvent.from_json(e) for e in events],
            checked_number(d.get("last_seq"), MAX_SEQ, "a KV-event batch's last_seq"),
            gap,
        )


def checked_number(v: object, top: int, what: str) -> int:
    """`v` if it is an integer from 0 to `top` (not a bool, a float: 1e400 is inf, or a string),
    else ValueError naming `what`: the one rule for a KV event's seq and hashes, whichever path
    (HTTP, Redis) brought them."""
    if type(v) is not int or not 0 <= v <= top:
        raise ValueError(f"{what} must be an integer from 0 to {top}, not {shown(v)}")
    return v


def checked_hashes(v: object, what: str) -> tuple[int, ...]:
    """`v` as block hashes: integers, each 64-bit unsigned (`checked_ints`)."""
    return checked_ints(v, MAX_HASH, what)


def checked_ints(v: object, top: int, what: str) -> tuple[int, ...]:
    """`v` as a list of integers, each from 0 to `top` (a tuple), else ValueError naming `what`.
    Types by one set and the range by min and max, not item by item: this runs over every hash
    and token id a peer sends."""
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"{what} must be a list of integers, not {shown(v)}")
    if not set(map(type, v)) <= {int}:
        raise ValueError(f"{what} must be integers, not {shown(next(h for h in v if type(h) is not int))}")
    if v and (min(v) < 0 or max(v) > top):
        raise ValueError(f"{what} must be from 0 to {top}, not {min(v) if min(v) < 0 else max(v)}")
    return tuple(v)


def _str(v: object, what: str) -> str:
    if type(v) is not str:
        raise ValueError(f"{what} must be a string, not {shown(v)}")
    return v


def shown(v: object) -> str:
    """A peer's value as an error message shows it: a scalar's repr, cut short; a container's
    type alone (its repr can be megabytes, or nest past the recursion limit)."""
    return repr(v)[:60] if v is None or isinstance(v, (bool, int, float, str)) else type(v).__name__


class EventLog:
    """A bounded, thread-safe log that numbers events. Listeners hear of new events in batches,
    once per `publish` (the engine publishes once per step, as vLLM drains `take_events`): a
    listener on another thread wakes once a step, not once an event."""

    def __init__(self, worker_id: str, capacity: int = 65536):
        self.worker_id = worker_id
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._seq = 0
        self._lock = Lock()
        self._listeners: list[Callable[[list[KVEvent]], None]] = []
        self._unpublished: list[KVEvent] = []

    @property
    def last_seq(self) -> int:
        return self._seq

    def subscribe(self, fn: Callable[[list[KVEvent]], None]) -> None:
        """Call fn(events) at each `publish` with the events appended since the last one."""
        self._listeners.append(fn)

    def append(
        self, kind: str, hashes: tuple[int, ...] = (), parent: int | None = None, medium: str = DEVICE
    ) -> KVEvent:
        with self._lock:
            self._seq += 1
            ev = KVEvent(self._seq, kind, tuple(hashes), parent, medium=medium)
            self._events.append(ev)
        self._unpublished.append(ev)
        return ev

    def publish(self) -> None:
        """Hand the events appended since the last publish to every listener, as one list."""
        if not self._unpublished:
            return
        batch, self._unpublished = self._unpublished, []
        for fn in self._listeners:
            fn(batch)

    def after(self, seq: int, limit: int = 4096) -> EventBatch:
        """Events with seq > `seq`; `gap` when some of them have been dropped from the log."""
        with self._lock:
            oldest = self._events[0].seq if self._events else self._seq + 1
            if seq + 1 < oldest and seq < self._seq:
                return EventBatch(self.worker_id, [], self._seq, gap=True)
            start = max(0, seq + 1 - oldest)
            evs = [self._events[i] for i in range(start, min(len(self._events), start + limit))]
            return EventBatch(self.worker_id, evs, self._seq)
