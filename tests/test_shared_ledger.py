"""Ledger entries shared between gateway replicas (gateway/shared_ledger.py): the notes and
their checks, how a replica applies another's, and two replicas over a test-started
redis-server (never port 6379)."""

import asyncio
import json
import time

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from gateway.cli_args import parser
from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.procs import start_redis, wait_redis
from gateway.redis_state import RedisState
from gateway.replica_share import packed
from gateway.server import build
from gateway import shared_ledger
from gateway.shared_ledger import ENDED, HELLO, ROUTED, SENT, SNAPSHOT, STARTED, TALLY, Held, LedgerNote, SharedLedgers
from policies.api import RequestView, Tally
from policies.ledger import MAX_TOKENS, Sent
from policies.routed import RoutedPrefixes
from tests.test_redis import wait_async
from tests.views import worker
from workers.kv import redis_schema as rs

sents = st.builds(
    Sent,
    need=st.integers(0, 10_000),
    hit=st.lists(st.integers(0, (1 << 64) - 1), max_size=20).map(tuple),
    max_tokens=st.integers(1, 10_000),
    started_at=st.none() | st.floats(0, 2e9),
)
ids = st.text("abcdef0123456789-_/:.", min_size=1, max_size=40)


@given(
    st.sampled_from([SENT, STARTED, ENDED]),
    ids,
    ids,
    ids,
    sents,
    st.floats(0, 2e9),
)
def test_a_note_reads_back_as_it_was_written(kind, replica, wid, rid, sent, at):
    note = LedgerNote(replica, kind, wid, rid, sent if kind == SENT else None, at if kind == STARTED else None)
    assert LedgerNote.from_json(json.loads(json.dumps(note.to_json()))) == note


@given(ids, st.lists(st.tuples(ids, ids, sents), max_size=5))
def test_a_snapshot_reads_back_as_it_was_written(replica, entries):
    note = LedgerNote(replica, SNAPSHOT, entries=tuple(Held(*e) for e in entries))
    assert LedgerNote.from_json(json.loads(json.dumps(note.to_json()))) == note


@given(ids, ids, ids, st.lists(st.integers(0, (1 << 64) - 1), max_size=20), st.integers(0, 10**6), st.floats(0, 2e9))
def test_a_routed_note_reads_back_as_it_was_written(replica, wid, rid, prompt, n, at):
    note = LedgerNote(replica, ROUTED, wid, rid, at=at, prompt=tuple(prompt), num_tokens=n)
    assert LedgerNote.from_json(json.loads(json.dumps(note.to_json()))) == note


@given(ids, st.booleans(), st.integers(0, 10**7), st.none() | st.integers(0, (1 << 64) - 1))
def test_a_tally_note_reads_back_as_it_was_written(replica, refused, footprint, prefix):
    note = LedgerNote(replica, TALLY, tally=Tally(refused, footprint, prefix))
    assert LedgerNote.from_json(json.loads(json.dumps(note.to_json()))) == note


GOOD_SENT = {"need": 3, "hit": [1, 2], "max_tokens": 8, "started_at": None}
GOOD_TALLY = {"refused": False, "footprint": 300, "prefix": 7}
SENT_R = {"replica": "a", "kind": SENT, "worker_id": "w0", "request_id": "r"}  # a sent note but its entry
ROUTED_R = {"replica": "a", "kind": ROUTED, "worker_id": "w0", "request_id": "r"}
ROUTED_AT = {**ROUTED_R, "at": 1.0}  # a routed note but its prompt


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"replica": "a", "kind": "launch"},
        {"replica": "", "kind": HELLO},
        {"replica": "a b", "kind": HELLO},
        {"replica": "a" * 300, "kind": HELLO},
        {"replica": "a", "kind": SENT, "worker_id": "w0", "request_id": "r"},  # no entry
        {"replica": "a", "kind": SENT, "sent": GOOD_SENT},  # no worker or request
        {"replica": "a", "kind": STARTED, "worker_id": "w0", "request_id": "r"},  # no time
        {**SENT_R, "sent": {**GOOD_SENT, "need": -1}},
        {**SENT_R, "sent": {**GOOD_SENT, "max_tokens": 0}},
        {**SENT_R, "sent": {**GOOD_SENT, "need": True}},
        {**SENT_R, "sent": {**GOOD_SENT, "hit": ["1"]}},
        {**SENT_R, "sent": {**GOOD_SENT, "hit": 5}},
        {**SENT_R, "sent": {**GOOD_SENT, "started_at": "now"}},
        {**ROUTED_R, "prompt": [1], "num_tokens": 16},
        {**ROUTED_AT, "prompt": [-1], "num_tokens": 16},
        {**ROUTED_AT, "prompt": "1", "num_tokens": 1},
        {**ROUTED_AT, "prompt": [], "num_tokens": True},
        {"replica": "a", "kind": ROUTED, "at": 1.0, "prompt": [], "num_tokens": 0},  # no worker or request
        {"replica": "a", "kind": ENDED, "worker_id": "w0", "request_id": "r", "at": "soon"},
        {"replica": "a", "kind": ENDED, "worker_id": "w0", "request_id": "r", "at": float("nan")},
        {"replica": "a", "kind": TALLY},  # no tally
        {"replica": "a", "kind": TALLY, "tally": [False, 300, 7]},
        {"replica": "a", "kind": TALLY, "tally": {**GOOD_TALLY, "refused": 1}},
        {"replica": "a", "kind": TALLY, "tally": {**GOOD_TALLY, "footprint": -1}},
        {"replica": "a", "kind": TALLY, "tally": {**GOOD_TALLY, "footprint": 3.5}},
        {"replica": "a", "kind": TALLY, "tally": {"refused": True, "prefix": 7}},  # no footprint
        {"replica": "a", "kind": TALLY, "tally": {**GOOD_TALLY, "prefix": "7"}},
        {"replica": "a", "kind": TALLY, "tally": {**GOOD_TALLY, "prefix": True}},
        {"replica": "a", "kind": SNAPSHOT, "entries": {"w0": []}},
        {"replica": "a", "kind": SNAPSHOT, "entries": [["w0", "r"]]},
        {"replica": "a", "kind": SNAPSHOT, "entries": [["w0", "r", {**GOOD_SENT, "hit": [-1]}]]},
        {**SENT_R, "sent": {**GOOD_SENT, "max_tokens": 10**400}},
        {**SENT_R, "sent": {**GOOD_SENT, "max_tokens": MAX_TOKENS + 1}},
        {**SENT_R, "sent": {**GOOD_SENT, "need": 1 << 64}},
        {**SENT_R, "sent": {**GOOD_SENT, "hit": [1 << 64]}},
        {**ROUTED_AT, "prompt": [], "num_tokens": 10**400},
    ],
)
def test_a_malformed_note_is_refused(doc):
    with pytest.raises(ValueError):
        LedgerNote.from_json(doc)


def fleet_of(n: int) -> Fleet:
    fleet = Fleet(ResidencyIndex())
    for i in range(n):
        fleet.add(f"http://127.0.0.1:1/{i}").worker_id = f"w{i}"
    return fleet


def test_another_replicas_notes_land_in_this_replicas_ledgers_under_its_name():
    fleet = fleet_of(2)
    shared = SharedLedgers(fleet, "b")
    w0 = fleet.by_id("w0")
    assert w0 is not None
    assert not shared.apply(LedgerNote("a", SENT, "w0", "r1", Sent(4, (7,), 8)))
    assert not shared.apply(LedgerNote("b", SENT, "w0", "mine", Sent(4, (), 8)))  # its own echo: ignored
    assert list(w0.ledger.sent) == ["a/r1"] and w0.ledger.sent["a/r1"].started_at is None
    shared.apply(LedgerNote("a", STARTED, "w0", "r1", at=5.0))
    assert w0.ledger.sent["a/r1"].started_at == 5.0 and w0.ledger.pinned == {7: 1}
    shared.apply(LedgerNote("a", ENDED, "w0", "r1"))
    assert not w0.ledger.sent and not w0.ledger.pinned
    shared.apply(LedgerNote("a", SENT, "w9", "r2", Sent(1, (), 1)))  # a worker this replica lacks
    assert not shared.held.get("a")
    assert shared.apply(LedgerNote("a", HELLO))  # asks for this replica's snapshot
    routed: list[LedgerNote] = []
    shared.on_routed = routed.append
    note = LedgerNote("a", ROUTED, "w0", "r5", at=1.0, prompt=(1, 2), num_tokens=40)
    assert not shared.apply(note) and routed == [note]
    shared.apply(LedgerNote("b", ROUTED, "w0", "r6", at=1.0, prompt=(1, 2), num_tokens=40))  # its own
    assert routed == [note] and list(w0.ledger.sent) == []  # a routing is no ledger entry


def test_a_routing_stamped_ahead_of_this_clock_leaves_with_the_window():
    """A routed note's time may be any finite number: one far ahead of this replica's clock sat
    at the head of the policy's memory, and nothing behind it ever expired."""
    fleet = fleet_of(1)
    shared = SharedLedgers(fleet, "b")
    memory = RoutedPrefixes(window_s=1.0)
    w0 = worker("w0", block_size=16)
    shared.on_routed = lambda note: memory.remember(RequestView("r", note.num_tokens, note.prompt), w0, note.at)
    shared.apply(LedgerNote("a", ROUTED, "w0", "r1", at=1e300, prompt=(1, 2, 3), num_tokens=64))
    shared.apply(LedgerNote("a", ROUTED, "w0", "r2", at=time.time(), prompt=(4, 5, 6), num_tokens=64))
    shared.apply(LedgerNote("a", ROUTED, "w0", "r3", at=-1e308, prompt=(7, 8, 9), num_tokens=64))
    assert [h for _, hashes in memory.sent.items for h in hashes] == list(range(1, 10))
    assert [t for t, _ in memory.sent.items] == sorted(t for t, _ in memory.sent.items), "kept in time order"
    memory.expire(time.time() + 10.0)
    assert not memory.sent and not memory.first and memory.pending_blocks("w0") == 0


def test_a_replica_holds_at_most_max_held_entries(monkeypatch):
    monkeypatch.setattr(shared_ledger, "MAX_HELD", 3)
    fleet = fleet_of(1)
    shared = SharedLedgers(fleet, "b")
    for i in range(5):
        shared.apply(LedgerNote("a", SENT, "w0", f"r{i}", Sent(1, (), 1)))
    shared.apply(LedgerNote("c", SENT, "w0", "r0", Sent(1, (), 1)))
    w0 = fleet.by_id("w0")
    assert w0 is not None and list(w0.ledger.sent) == ["a/r0", "a/r1", "a/r2", "c/r0"]


def test_a_snapshot_replaces_what_the_replica_held_and_leaves_out_the_others_entries():
    fleet = fleet_of(2)
    shared = SharedLedgers(fleet, "b")
    w0, w1 = fleet.by_id("w0"), fleet.by_id("w1")
    assert w0 is not None and w1 is not None
    fleet.begin(w1, "own", Sent(2, (), 4))
    shared.apply(LedgerNote("a", SENT, "w0", "old", Sent(4, (), 8, started_at=1.0)))
    shared.apply(LedgerNote("a", SNAPSHOT, entries=(Held("w1", "new", Sent(3, (), 8)),)))
    assert list(w0.ledger.sent) == [] and list(w1.ledger.sent) == ["own", "a/new"]
    mine = shared.snapshot()
    assert mine == LedgerNote("b", SNAPSHOT, entries=(Held("w1", "own", Sent(2, (), 4)),))
    shared.drop("a")
    assert list(w1.ledger.sent) == ["own"]


def test_the_fleet_notes_its_own_ledger_changes_and_only_for_entries_it_holds():
    fleet = fleet_of(1)
    w0 = fleet.by_id("w0")
    assert w0 is not None
    notes: list[LedgerNote] = []
    fleet.on_ledger = notes.append
    fleet.begin(w0)  # no entry (a prefill leg): nothing to note
    fleet.begin(w0, "r1", Sent(2, (), 4))
    fleet.started(w0, "r1", 3.0)
    fleet.started(w0, "r1", 4.0)  # only its first token counts
    fleet.end(w0, "r1")
    fleet.end(w0)
    assert [(n.kind, n.request_id) for n in notes] == [(SENT, "r1"), (STARTED, "r1"), (ENDED, "r1")]
    assert notes[1].at == 3.0 and w0.in_flight == 0 and not w0.ledger.sent


def covered(fleet: Fleet, wid: str) -> bool:
    """The condition under which `predict.ledger_wait_ms` prices a wait from the ledger."""
    w = fleet.by_id(wid)
    assert w is not None
    return w.in_flight + w.shared_in_flight == len(w.ledger)


@given(st.lists(st.text(st.characters(blacklist_characters="\n"), max_size=40), max_size=30), st.integers(1, 100))
def test_packed_lines_keep_their_order_within_the_size(lines, limit):
    """Joined back, the messages are the lines in order; each fits `limit` unless it is one line."""
    messages = list(packed(lines, limit))
    assert [line for m in messages for line in m.split("\n")] == (lines or [])
    assert all(len(m) <= limit or "\n" not in m for m in messages)
    assert not lines or len(messages) <= len(lines)


def test_one_message_of_lines_applies_each_and_drops_only_the_bad_ones():
    """A message holds one flush of another replica's lines: deltas and notes are applied in
    order, a malformed line is counted and the rest still land; this replica's own lines
    change nothing."""
    fleet = fleet_of(2)
    state = RedisState("redis://127.0.0.1:1/0", fleet, "secret", replica_id="b")
    sent = json.dumps({"replica": "a", "kind": SENT, "worker_id": "w0", "request_id": "r1", "sent": GOOD_SENT})
    state.share.message("\n".join(["a 1 w0 1", "a 2 w0 9", sent, "{broken"]).encode())
    w0 = fleet.by_id("w0")
    assert w0 is not None
    assert w0.shared_in_flight == 1 and set(w0.ledger.sent) == {"a/r1"} and state.malformed["share_line"] == 2
    own = json.dumps({"replica": "b", "kind": SENT, "worker_id": "w0", "request_id": "r2", "sent": GOOD_SENT})
    state.share.message(f"b 1 w0 1\n{own}".encode())
    state.share.message(f"{own}\nb 1 w0 1".encode())
    assert w0.shared_in_flight == 1 and set(w0.ledger.sent) == {"a/r1"} and state.malformed["share_line"] == 2


@pytest.mark.slow
def test_two_replicas_each_hold_the_whole_fleets_ledger(tmp_path):
    """Over one redis-server: what replica a sends, starts and ends shows in b's ledger with
    the count b sees, so b's ledger covers the worker; a reconnected b gets a's entries back
    (it says hello, a answers with a snapshot); a malformed message is dropped and the rest
    still land, a malformed in-flight table is dropped and the replica stays on Redis; when a
    goes, its entries go."""
    proc = wait_redis(start_redis(log_dir=str(tmp_path)))
    url = f"redis://127.0.0.1:{proc.port}/0"

    async def scenario() -> None:
        fa, fb = fleet_of(2), fleet_of(2)
        sa = RedisState(url, fa, "secret", replica_id="a", inflight_interval=0.1)
        sb = RedisState(url, fb, "secret", replica_id="b", inflight_interval=0.1)
        await sa.start()
        await sb.start()
        try:
            await wait_async(lambda: sa.up and sb.up and fa.on_ledger and fb.on_ledger)
            await asyncio.sleep(0.3)  # both subscribed
            wa, wb = fa.by_id("w0"), fb.by_id("w0")
            assert wa is not None and wb is not None
            fa.begin(wa, "r1", Sent(5, (11, 12), 16))
            fa.begin(wa, "r2", Sent(6, (11,), 16))
            fb.begin(wb, "r3", Sent(2, (), 4))
            await wait_async(lambda: set(wb.ledger.sent) == {"a/r1", "a/r2", "r3"} and wb.shared_in_flight == 2)
            assert covered(fb, "w0") and covered(fa, "w0") and set(wa.ledger.sent) == {"r1", "r2", "b/r3"}
            fa.started(wa, "r1", 100.0)
            await wait_async(lambda: wb.ledger.sent["a/r1"].started_at == 100.0)
            assert wb.ledger.pinned == {11: 1, 12: 1}
            fa.end(wa, "r1")
            await wait_async(lambda: "a/r1" not in wb.ledger.sent and wb.shared_in_flight == 1)
            assert covered(fb, "w0") and not wb.ledger.pinned

            r = redis.Redis.from_url(url)
            r.publish(rs.SHARE_CHANNEL, b"{not json")
            r.publish(rs.SHARE_CHANNEL, json.dumps({"replica": "x", "kind": SENT, "worker_id": "w0"}))
            r.publish(rs.SHARE_CHANNEL, b"x 1 w0 99")
            r.publish(rs.SHARE_CHANNEL, b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
            routed: list[LedgerNote] = []
            sb.ledgers.on_routed = routed.append
            fa.begin(fa.by_id("w1"), "r4", Sent(1, (), 2))
            fa.routed(fa.by_id("w1"), "r4", (7, 8), 40, 9.0)
            wb1 = fb.by_id("w1")
            assert wb1 is not None
            await wait_async(lambda: "a/r4" in wb1.ledger.sent and sb.malformed["share_line"] == 4)
            assert sb.up and wb.shared_in_flight == 1
            r.hset(rs.inflight_key("x"), mapping={"w0": "many", rs.SEQ_FIELD: 1})  # a table that does not parse
            r.sadd(rs.REPLICAS, "x", b"\xff")  # and a name that is not UTF-8
            await wait_async(lambda: sb.malformed["inflight_table"] >= 2 and sa.malformed["inflight_table"] >= 2)
            assert sb.up and sa.up and wb.shared_in_flight == 1 and "x" not in sb.share.tables
            r.delete(rs.inflight_key("x"))
            await wait_async(
                lambda: routed == [LedgerNote("a", ROUTED, "w1", "r4", at=9.0, prompt=(7, 8), num_tokens=40)]
            )
            tallies: list[Tally] = []
            sb.ledgers.on_tally = tallies.append
            fa.tallied(Tally(True, 300, 7))
            await wait_async(lambda: tallies == [Tally(True, 300, 7)])

            await sb.stop()  # b forgets the others' entries while it is away ...
            assert set(wb.ledger.sent) == {"r3"}
            await sb.start()  # ... and gets them back from a's answer to its hello
            await wait_async(lambda: sb.up and set(wb.ledger.sent) == {"a/r2", "r3"})
            await wait_async(lambda: covered(fb, "w0") and set(wa.ledger.sent) == {"r2", "b/r3"})

            await sa.stop()  # a is gone: its table expires and b drops its entries
            # and its load: a replica that left the set has its entries dropped at one read and its
            # table at the read it expires, so the two agree again within a read (predict's check)
            await wait_async(
                lambda: set(wb.ledger.sent) == {"r3"} and not wb1.ledger.sent and covered(fb, "w0"), timeout=10
            )
        finally:
            await sa.stop()
            await sb.stop()

    try:
        asyncio.run(scenario())
    finally:
        proc.stop()


@pytest.mark.parametrize("policy", ["prefix_affinity", "slo_goodput", "round_robin"])
def test_another_replicas_routing_reaches_a_policy_that_remembers_its_own(policy):
    """A built gateway with Redis hands `routed` notes to its policy (`policies.api.Observer`);
    one that remembers nothing (round robin) is left alone."""
    argv = ["--worker", "http://127.0.0.1:1", "--redis", "redis://127.0.0.1:1/0", "--internal-token", "t"]
    gw = build(parser().parse_args([*argv, "--policy", policy, "--model", "smollm2-135m"]))
    (w,) = gw.fleet.workers.values()
    gw.fleet.up(w, {"worker_id": "w0", "model": "smollm2-135m", "block_size": 16})
    prompt = tuple(range(100, 104))
    gw.redis.ledgers.apply(LedgerNote("other", ROUTED, "w0", "r1", at=5.0, prompt=prompt, num_tokens=65))
    gw.redis.ledgers.apply(LedgerNote("other", ROUTED, "w9", "r2", at=5.0, prompt=(7,), num_tokens=17))  # unknown
    memory = getattr(gw.policy, "routed", None)
    if policy == "round_robin":
        assert memory is None
    else:
        assert {h: worker for h, (worker, _, _) in memory.first.items()} == dict.fromkeys(prompt, "w0")


@pytest.mark.parametrize("policy", ["slo_goodput", "round_robin"])
def test_decisions_go_to_the_other_replicas_and_theirs_reach_a_policy_that_keeps_windows(policy):
    """A built gateway with Redis hands `tally` notes to its policy (`policies.api.Tallied`):
    slo_goodput counts another replica's refusal, request size and prefix demand as its own;
    and each of its own decisions goes out as a tally. Round robin keeps no windows: it says
    nothing and is left alone."""
    argv = ["--worker", "http://127.0.0.1:1", "--redis", "redis://127.0.0.1:1/0", "--internal-token", "t"]
    if policy == "slo_goodput":  # a window no pause of a busy machine outlasts: the test reads what was counted
        argv += ["--policy-arg", "refusal_window_s=3600"]
    gw = build(parser().parse_args([*argv, "--policy", policy, "--model", "smollm2-135m"]))
    (w,) = gw.fleet.workers.values()
    gw.fleet.up(w, {"worker_id": "w0", "model": "smollm2-135m", "block_size": 16, "total_blocks": 1024})
    gw.redis.ledgers.apply(LedgerNote("other", TALLY, tally=Tally(True, 500, 9)))
    gw.redis.ledgers.apply(LedgerNote(gw.redis.share.replica, TALLY, tally=Tally(True, 700, 9)))  # its own echo
    notes: list[LedgerNote] = []
    gw.fleet.on_ledger = notes.append
    chosen, *_ = gw.decide(RequestView("r1", 70, (1, 2, 3, 4), max_tokens=30), "smollm2-135m", set())
    assert chosen is w
    tallies = [n.tally for n in notes if n.kind == TALLY]
    if policy == "round_robin":
        assert not tallies
        return
    p = gw.policy
    assert p.footprints.ordered == [100, 500] and p.warmer.requests.count == {9: 1}
    assert [refused for _, refused in p.refusals.decisions.window.items] == [
        True,
        False,
    ]  # the other's refusal, this admission
    assert p.refusals.share(p.refusals.decisions.window.items[-1][0]) == 0.5
    assert tallies == [Tally(False, 100, None)]
