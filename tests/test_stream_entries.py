"""The KV-event stream in Redis: one entry per flush of a worker's events (workers/kv/redis_schema.py),
read back as written, old single-event entries still read, malformed ones refused and skipped
by the gateway without stopping its tail, as are resident sets that do not parse
(gateway/redis_state.py)."""

import pytest
from hypothesis import given, strategies as st

from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.redis_state import RedisState
from workers.kv import redis_schema as rs
from workers.kv.events import CLEARED, DEVICE, HOST, MEDIA, REMOVED, STORED, KVEvent

U64 = st.integers(0, 2**64 - 1)


@st.composite
def flushes(draw) -> list[KVEvent]:
    first = draw(st.integers(0, 2**40))
    kinds = draw(st.lists(st.sampled_from(rs.KINDS), min_size=1, max_size=8))
    return [
        KVEvent(
            first + i,
            kind,
            tuple(draw(st.lists(U64, max_size=6))) if kind in (STORED, REMOVED) else (),
            draw(st.none() | U64),
            medium=draw(st.sampled_from(MEDIA)),
        )
        for i, kind in enumerate(kinds)
    ]


def as_read(fields: dict[str, str]) -> dict[bytes, bytes]:
    """A stream entry as redis-py gives it to a reader that does not decode responses."""
    return {k.encode(): v.encode() for k, v in fields.items()}


def same(a: KVEvent, b: KVEvent) -> bool:
    return (a.seq, a.kind, a.hashes, a.parent, a.medium) == (b.seq, b.kind, b.hashes, b.parent, b.medium)


@given(flushes())
def test_a_flush_reads_back_as_written(events):
    wid, back = rs.decode_events(as_read(rs.encode_events("w7", events)))
    assert wid == "w7" and len(back) == len(events) and all(map(same, back, events))


def test_an_entry_of_an_older_worker_is_one_event():
    old = {b"w": b"w1", b"s": b"12", b"k": b"stored", b"h": b"5 6", b"p": b"4"}
    wid, (ev,) = rs.decode_events(old)
    assert wid == "w1" and same(ev, KVEvent(12, STORED, (5, 6), 4, medium=DEVICE))
    wid, (ev,) = rs.decode_events({b"w": b"w1", b"s": b"13", b"k": b"removed", b"h": b"9", b"p": b"", b"m": b"host"})
    assert same(ev, KVEvent(13, REMOVED, (9,), None, medium=HOST))
    wid, (ev,) = rs.decode_events({b"w": b"w1", b"s": b"14", b"k": b"cleared", b"p": b""})
    assert same(ev, KVEvent(14, CLEARED))


@pytest.mark.parametrize(
    "fields",
    [
        {b"e": b"1 stored device - 5"},  # no worker
        {b"w": b"w1"},  # neither a batch nor an old event
        {b"w": b"w1", b"e": b""},
        {b"w": b"w1", b"e": b"1 stored device"},  # no parent
        {b"w": b"w1", b"e": b"x stored device - 5"},
        {b"w": b"w1", b"e": b"1 stolen device - 5"},
        {b"w": b"w1", b"e": b"1 stored gpu9 - 5"},
        {b"w": b"w1", b"e": b"1 stored device - 5 five"},
        {b"w": b"w1", b"e": b"1 stored device 4.5 5"},
        {b"w": b"w1", b"e": b"1 stored device - 5\n2 \xff device - 6"},
        {b"w": b"\xff", b"e": b"1 stored device - 5"},
        {b"w": b"w1", b"s": b"1", b"k": b"stored", b"h": b"a b"},
        {b"w": b"w1", b"e": b"-1 stored device - 5"},  # a seq below 0
        {b"w": b"w1", b"e": b"1 stored device - -5"},  # a hash below 0
        {b"w": b"w1", b"e": b"1 stored device -7 5"},  # a parent below 0
        {b"w": b"w1", b"e": b"1 stored device - " + str(1 << 64).encode()},  # past 64 bits
        {b"w": b"w1", b"e": str(1 << 63).encode() + b" stored device - 5"},
    ],
)
def test_a_malformed_entry_is_refused(fields):
    with pytest.raises(ValueError):
        rs.decode_events(fields)


def test_the_gateway_skips_a_malformed_entry_and_applies_the_next():
    fleet = Fleet(ResidencyIndex())
    w = fleet.add("http://127.0.0.1:1/0")
    w.worker_id, w.redis_residency = "w0", True
    fleet.index.reset("w0", [], 0)
    state = RedisState("redis://127.0.0.1:1/0", fleet, "secret", replica_id="a")
    state._apply({b"w": b"w0", b"e": b"1 stored device - 5\n2 bogus device - 6"})
    assert state.malformed["event_entry"] == 1 and fleet.index.seq("w0") == 0
    state._apply(as_read(rs.encode_events("w0", [KVEvent(1, STORED, (5, 6)), KVEvent(2, REMOVED, (5,))])))
    assert fleet.index.seq("w0") == 2 and fleet.index.holds("w0", 6) and not fleet.index.holds("w0", 5)
    state._apply(as_read(rs.encode_events("w0", [KVEvent(4, STORED, (7,))])))  # a gap: resync from the set
    assert fleet.index.seq("w0") is None


def test_the_gateway_skips_resident_sets_that_do_not_parse():
    """A worker's resident set in Redis holding something that is not a hash leaves that worker
    unsynced (counted), instead of failing the bootstrap of every worker."""
    fleet = Fleet(ResidencyIndex())
    state = RedisState("redis://127.0.0.1:1/0", fleet, "secret", replica_id="a")
    state._reset("w0", [{b"5", b"not-a-hash"}, set(), set()], b"3")
    assert state.malformed["resident_set"] == 1 and fleet.index.seq("w0") is None
    state._reset("w0", [{b"5"}, set(), set()], b"x")
    assert state.malformed["resident_set"] == 2 and fleet.index.seq("w0") is None
    state._reset("w1", [{b"5", b"6"}, {b"7"}, set()], b"3")
    assert fleet.index.seq("w1") == 3 and fleet.index.holds("w1", 6)


NUMBERS = st.integers(-(2**65), 2**65) | st.sampled_from([-1, 0, 2**63 - 1, 2**63, 2**64 - 1, 2**64])


@given(NUMBERS, st.lists(NUMBERS, max_size=4), st.none() | NUMBERS)
def test_a_stream_entry_and_a_workers_json_hold_an_events_numbers_to_one_rule(seq, hashes, parent):
    event = KVEvent(seq, STORED, tuple(hashes), parent)

    def accepted(read) -> bool:
        try:
            read()
        except ValueError:
            return False
        return True

    by_redis = accepted(lambda: rs.decode_events(as_read(rs.encode_events("w1", [event]))))
    by_http = accepted(lambda: KVEvent.from_json(event.to_json()))
    in_range = 0 <= seq < 2**63 and all(0 <= h < 2**64 for h in [*hashes, *([] if parent is None else [parent])])
    assert by_redis == by_http == in_range
