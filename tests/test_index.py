"""The gateway's residency index: event application, gaps, snapshot resync, prefix matching."""

import random

from hypothesis import given, settings, strategies as st

from gateway.index import RESYNC, ResidencyIndex
from workers.kv.block_pool import BlockPool
from workers.kv.events import CLEARED, REMOVED, STORED, EventBatch, EventLog, KVEvent
from workers.kv.hashing import block_hashes, seed_hash


def batch(wid: str, *events: KVEvent, gap: bool = False) -> EventBatch:
    return EventBatch(wid, list(events), events[-1].seq if events else 0, gap)


def synced(*wids: str) -> ResidencyIndex:
    idx = ResidencyIndex()
    for w in wids:
        idx.reset(w, [], 0)
    return idx


def test_stored_removed_cleared_update_both_directions():
    idx = synced("a", "b")
    assert idx.apply(batch("a", KVEvent(1, STORED, (1, 2, 3)))) is None
    assert idx.apply(batch("b", KVEvent(1, STORED, (1, 2)))) is None
    assert idx.match([1, 2, 3]) == {"a": 3, "b": 2}
    idx.apply(batch("a", KVEvent(2, REMOVED, (2,))))
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 2}
    idx.apply(batch("b", KVEvent(2, CLEARED)))
    assert idx.match([1, 2, 3]) == {"a": 1}
    assert idx.num_blocks("a") == 2 and idx.num_blocks("b") == 0 and idx.num_blocks() == 2


def test_a_gap_in_seq_asks_for_resync_and_applies_nothing_past_it():
    idx = synced("a")
    idx.apply(batch("a", KVEvent(1, STORED, (1,))))
    assert idx.apply(batch("a", KVEvent(3, STORED, (2,)))) == RESYNC
    assert idx.seq("a") == 1 and not idx.holds("a", 2)


def test_gap_flag_unsynced_worker_and_restart_ask_for_resync():
    idx = synced("a")
    assert idx.apply(EventBatch("a", [], 10, gap=True)) == RESYNC
    assert idx.apply(batch("never-synced", KVEvent(1, STORED, (1,)))) == RESYNC
    idx.apply(batch("a", KVEvent(1, STORED, (1,)), KVEvent(2, STORED, (2,))))
    assert idx.apply(EventBatch("a", [], 0)) == RESYNC, "numbering went backwards: the worker restarted"


def test_duplicate_events_are_skipped():
    idx = synced("a")
    e1, e2 = KVEvent(1, STORED, (1,)), KVEvent(2, REMOVED, (1,))
    idx.apply(batch("a", e1, e2))
    assert idx.apply(batch("a", e1, e2)) is None
    assert not idx.holds("a", 1) and idx.seq("a") == 2


def test_snapshot_resync_replaces_residency_and_drop_forgets():
    idx = synced("a", "b")
    idx.apply(batch("a", KVEvent(1, STORED, (1, 2))))
    idx.apply(batch("b", KVEvent(1, STORED, (1,))))
    idx.reset("a", [7, 8], seq=40)
    assert idx.seq("a") == 40 and idx.match([1]) == {"b": 1} and idx.match([7, 8]) == {"a": 2}
    idx.drop("b")
    assert idx.seq("b") is None and idx.match([1]) == {} and idx.num_blocks() == 2


def test_match_is_the_longest_contiguous_prefix_per_worker():
    idx = ResidencyIndex()
    idx.reset("a", [1, 2, 3, 4], 0)
    idx.reset("b", [1, 3, 4], 0)
    idx.reset("c", [2, 3], 0)
    assert idx.match([1, 2, 3, 4]) == {"a": 4, "b": 1}
    assert idx.match([]) == {} and idx.match([9, 1]) == {}


ops = st.lists(
    st.tuples(st.sampled_from([STORED, REMOVED, CLEARED]), st.lists(st.integers(0, 30), max_size=6)), max_size=40
)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(0, 40), st.lists(st.integers(0, 30), max_size=12))
def test_events_then_resync_equal_the_model_and_match_equals_brute_force(events, cut, query):
    """Applying any event sequence (with a resync at any point) leaves the index equal to the
    set the events describe, and `match` equals the brute-force longest prefix."""
    idx, model, seq = synced("w"), set(), 0
    for i, (kind, hs) in enumerate(events):
        seq += 1
        if kind == STORED:
            model |= set(hs)
        elif kind == REMOVED:
            model -= set(hs)
        else:
            model = set()
        if i == cut:
            idx.reset("w", model, seq)
        else:
            assert idx.apply(batch("w", KVEvent(seq, kind, tuple(hs)))) is None
    assert {h for h in range(31) if idx.holds("w", h)} == model
    n = next((i for i, h in enumerate(query) if h not in model), len(query))
    assert idx.match(query) == ({"w": n} if n else {})


def test_mirrors_a_real_block_pool_through_its_event_log():
    """The worker's own pool and log drive the index; a reader that fell behind the bounded
    log gets a gap and recovers from a snapshot."""
    log = EventLog("w", capacity=8)
    pool = BlockPool(16, 4, log)
    idx, rng = synced("w"), random.Random(0)
    for step in range(60):
        blocks = pool.allocate(min(pool.num_free, rng.randint(1, 3)))
        base = rng.randint(0, 10_000)
        pool.register(blocks, [base + i for i in range(len(blocks))], [(step, i) for i in range(len(blocks))], None)
        pool.free(blocks)
        if step % 7 == 0:
            b = log.after(idx.seq("w"))
            if idx.apply(b) == RESYNC:
                idx.reset("w", pool.resident_hashes(), log.last_seq)
    if idx.apply(log.after(idx.seq("w"))) == RESYNC:
        idx.reset("w", pool.resident_hashes(), log.last_seq)
    assert {h for h in pool.resident_hashes()} == {h for h in range(20_000) if idx.holds("w", h)}


def test_match_64_workers_512_blocks():
    """Each worker's longest held prefix (how fast: `python -m bench.gateway_overhead --only decision`)."""
    seed = seed_hash("m", 16)
    hashes = block_hashes(list(range(8192)), 16, seed)
    idx = ResidencyIndex()
    for i in range(64):
        idx.reset(f"w{i}", hashes[: 8 * i + 8] + [hash((i, j)) for j in range(2000)], 0)
    assert idx.match(hashes) == {f"w{i}": 8 * i + 8 for i in range(64)}
