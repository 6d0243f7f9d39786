"""Ledger entries shared between gateway replicas (`policies.ledger`), through Redis pub/sub.

A router's ledger of a worker covers it only while it sent everything in flight there
(`predict.ledger_wait_ms` declines otherwise), so with two replicas neither would price a
pool wait from it. Each replica therefore publishes every change to its ledger (a request
sent, its first token, its end) and applies the others' to its own ledgers under
`replica/request id`, so each one's ledger of a worker holds the fleet's requests there.

Messages can be lost only across a reconnect, and a replica's first message after one is a
`hello`: every replica answers it with a snapshot of its own entries, and the reconnected
replica sends its own, which replaces what the others held of it. A replica whose in-flight
table expired (`gateway.redis_state`) is gone, and its entries with it. What is still missed
shows as a count unlike the ledger's, where the ledger declines as it does for a single router.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from policies.api import Tally
from policies.ledger import Sent, checked_count, checked_hashes, checked_time

if TYPE_CHECKING:  # the fleet hands its changes here through a callback
    from gateway.fleet import Fleet

SENT, STARTED, ENDED, SNAPSHOT, HELLO, ROUTED, TALLY = (
    "sent",
    "started",
    "ended",
    "snapshot",
    "hello",
    "routed",
    "tally",
)
KINDS = (SENT, STARTED, ENDED, SNAPSHOT, HELLO, ROUTED, TALLY)
MAX_ID = 256  # characters in a replica, worker or request id
MAX_HELD = 1 << 16  # entries of one replica, in one snapshot or held at once


@dataclass(frozen=True, slots=True)
class Held:
    """One entry of a replica's ledger: its request `request_id` at worker `worker_id`."""

    worker_id: str
    request_id: str
    sent: Sent


@dataclass(frozen=True, slots=True)
class LedgerNote:
    """One change to replica `replica`'s ledger: `sent` (its entry `sent`), `started` (first
    token at `at`), `ended`, `snapshot` (all it holds, `entries`), or `hello` (it reconnected:
    send it yours); or `routed`: at `at` it sent a prompt of `num_tokens` tokens whose full
    blocks hash to `prompt` to `worker_id` (where its prefill runs), for the others' policies
    to count as held there until the index shows it (`policies.routed`); or `tally`: a
    decision's `tally`, for the others' policies' windows over recent traffic
    (`policies.api.Tallied`)."""

    replica: str
    kind: str
    worker_id: str = ""
    request_id: str = ""
    sent: Sent | None = None
    at: float | None = None
    entries: tuple[Held, ...] = ()
    prompt: tuple[int, ...] = ()
    num_tokens: int = 0
    tally: Tally | None = None

    def to_json(self) -> dict:
        d: dict = {"replica": self.replica, "kind": self.kind}
        if self.worker_id:
            d["worker_id"], d["request_id"] = self.worker_id, self.request_id
        if self.sent is not None:
            d["sent"] = self.sent.to_json()
        if self.at is not None:
            d["at"] = self.at
        if self.kind == ROUTED:
            d["prompt"], d["num_tokens"] = list(self.prompt), self.num_tokens
        if self.tally is not None:
            d["tally"] = self.tally.to_json()
        if self.kind == SNAPSHOT:
            d["entries"] = [[h.worker_id, h.request_id, h.sent.to_json()] for h in self.entries]
        return d

    @classmethod
    def from_json(cls, d: object) -> LedgerNote:
        """The note `to_json` wrote; ValueError for anything else (whoever can publish in Redis
        can send it)."""
        if not isinstance(d, dict) or d.get("kind") not in KINDS:
            raise ValueError(f"a ledger note is an object with kind one of {KINDS}")
        kind = d["kind"]
        note = cls(
            _id(d.get("replica")),
            kind,
            _id(d.get("worker_id", ""), empty=True),
            _id(d.get("request_id", ""), empty=True),
            Sent.from_json(d["sent"]) if isinstance(d.get("sent"), dict) else None,
            checked_time(d.get("at")),
            _entries(d.get("entries")) if kind == SNAPSHOT else (),
            *(_prompt(d) if kind == ROUTED else ((), 0)),
            Tally.from_json(d.get("tally")) if kind == TALLY else None,
        )
        if kind in (SENT, STARTED, ENDED, ROUTED) and not (note.worker_id and note.request_id):
            raise ValueError(f"a {kind} note names its worker and request")
        if (kind == SENT and note.sent is None) or (kind in (STARTED, ROUTED) and note.at is None):
            raise ValueError(f"a {kind} note carries its {'entry' if kind == SENT else 'time'}")
        return note


def _id(x: object, empty: bool = False) -> str:
    if not isinstance(x, str) or len(x) > MAX_ID or (not x and not empty) or any(c.isspace() for c in x):
        raise ValueError(f"an id is a string of at most {MAX_ID} characters without spaces")
    return x


def _prompt(d: dict) -> tuple[tuple[int, ...], int]:
    return checked_hashes(d.get("prompt"), "a routed note's prompt"), checked_count(
        d.get("num_tokens"), "a routed note's num_tokens"
    )


def _entries(x: object) -> tuple[Held, ...]:
    if not isinstance(x, list) or len(x) > MAX_HELD:
        raise ValueError(f"a snapshot's entries are a list of at most {MAX_HELD}")
    out = []
    for e in x:
        if not isinstance(e, list) or len(e) != 3 or not isinstance(e[2], dict):
            raise ValueError("a snapshot entry is [worker id, request id, entry]")
        out.append(Held(_id(e[0]), _id(e[1]), Sent.from_json(e[2])))
    return tuple(out)


def _key(replica: str, request_id: str) -> str:
    """Where another replica's request sits in this replica's ledgers."""
    return f"{replica}/{request_id}"


class SharedLedgers:
    """The other replicas' entries in this replica's ledgers (`fleet`'s workers'), by who sent
    them: each under the key `replica/request id`."""

    def __init__(self, fleet: Fleet, replica: str) -> None:
        self.fleet, self.replica = fleet, replica
        self.held: dict[str, dict[str, str]] = {}  # other replica -> key -> worker id
        self.on_routed: Callable[[LedgerNote], None] | None = None  # another replica's routing
        self.on_tally: Callable[[Tally], None] | None = None  # another replica's decision

    def apply(self, note: LedgerNote) -> bool:
        """Apply another replica's note; True where it asks for this replica's snapshot. A
        routing goes on at its time or this replica's now, the earlier: a time ahead of this
        clock (a skewed one, or a lie) held the policy's memory of routings from expiring."""
        if note.replica == self.replica:
            return False
        if note.kind == HELLO:
            return True
        if note.kind == ROUTED:
            if self.on_routed is not None and note.at is not None:
                self.on_routed(replace(note, at=min(note.at, time.time())))
            return False
        if note.kind == TALLY:
            if self.on_tally is not None and note.tally is not None:
                self.on_tally(note.tally)
            return False
        if note.kind == SNAPSHOT:
            self.drop(note.replica)
            for h in note.entries:
                self._add(note.replica, h.worker_id, h.request_id, h.sent)
            return False
        key = _key(note.replica, note.request_id)
        w = self.fleet.by_id(note.worker_id)
        if note.kind == SENT and note.sent is not None:
            self._add(note.replica, note.worker_id, note.request_id, note.sent)
        elif note.kind == STARTED and w is not None and note.at is not None:
            w.ledger.start(key, note.at)
        elif note.kind == ENDED:
            self.held.get(note.replica, {}).pop(key, None)
            if w is not None:
                w.ledger.end(key)
        return False

    def _add(self, replica: str, worker_id: str, request_id: str, sent: Sent) -> None:
        """Hold one of `replica`'s entries, unless its worker is unknown here or the replica
        already holds `MAX_HELD` (no gateway has that many requests open: a bad publisher)."""
        w = self.fleet.by_id(worker_id)
        if w is None or len(self.held.get(replica, ())) >= MAX_HELD:
            return
        key = _key(replica, request_id)
        w.ledger.add(key, sent)
        self.held.setdefault(replica, {})[key] = worker_id

    def drop(self, replica: str) -> None:
        """Forget every entry of `replica` (it is gone, or sent a snapshot to replace them)."""
        for key, wid in self.held.pop(replica, {}).items():
            w = self.fleet.by_id(wid)
            if w is not None:
                w.ledger.end(key)

    def clear(self) -> None:
        for replica in list(self.held):
            self.drop(replica)

    def snapshot(self) -> LedgerNote:
        """This replica's own entries, every worker's."""
        foreign = {key for keys in self.held.values() for key in keys}
        entries = tuple(
            Held(w.worker_id, rid, sent)
            for w in self.fleet.workers.values()
            if w.worker_id
            for rid, sent in w.ledger.sent.items()
            if rid not in foreign
        )
        return LedgerNote(self.replica, SNAPSHOT, entries=entries)
