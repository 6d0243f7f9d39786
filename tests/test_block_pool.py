"""Block pool, prefix cache and KV events: ref counts, LRU eviction order, gap-free seqs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.kv.block_pool import BlockPool
from workers.kv.events import CLEARED, REMOVED, STORED, EventLog
from workers.kv.hashing import block_hash, block_hashes, seed_hash


def make_pool(n=8, B=4):
    return BlockPool(n, B, EventLog("w"))


def test_hash_chain_is_deterministic_and_prefix_sensitive():
    seed = seed_hash("m", 4)
    a = block_hashes(list(range(12)), 4, seed)
    assert a == block_hashes(list(range(12)), 4, seed)
    assert len(a) == 3 and all(0 <= h < 2**64 for h in a)
    b = block_hashes([99] + list(range(1, 12)), 4, seed)
    assert all(x != y for x, y in zip(a, b)), "a changed first block changes every later hash"
    assert block_hashes(list(range(12)), 4, seed, start=1, parent=a[0]) == a[1:]
    assert seed != seed_hash("m", 16) and seed != seed_hash("other", 4)
    assert block_hash(seed, [0, 1, 2, 3]) == a[0]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 2**40), max_size=200),
    st.sampled_from((1, 4, 16, 32)),
    st.integers(0, 2**64 - 1),
    st.integers(0, 8),
)
def test_block_hashes_is_the_chain_of_block_hash(tokens, B, seed, start):
    """`block_hashes` packs a prompt's ids once for speed; each hash must still be `block_hash`
    of its parent and its block, as every worker and the gateway compute it."""
    n = len(tokens) // B
    chain, prev = [], seed
    for i in range(n):
        prev = block_hash(prev, tokens[i * B : (i + 1) * B])
        chain.append(prev)
    assert block_hashes(tokens, B, seed) == chain
    parent = chain[start - 1] if 0 < start <= n else seed
    assert block_hashes(tokens, B, seed, start=start, parent=parent) == chain[start:]


def test_partial_blocks_are_not_hashed():
    assert block_hashes(list(range(7)), 4, 0) == block_hashes(list(range(4)), 4, 0)


def test_allocate_free_and_ref_counts():
    pool = make_pool()
    blocks = pool.allocate(3)
    assert pool.num_free == 5 and all(b.ref_count == 1 for b in blocks)
    pool.free(blocks)
    assert pool.num_free == 8


def test_lookup_checks_tokens_and_touch_takes_reference():
    pool = make_pool()
    [b] = pool.allocate(1)
    pool.register([b], [123], [(1, 2, 3, 4)], None)
    assert pool.lookup(123, (1, 2, 3, 4)) is b
    assert pool.lookup(123, (1, 2, 3, 5)) is None, "a hash hit with other tokens is a miss"
    pool.free([b])
    assert pool.num_free == 8
    pool.touch(b)
    assert b.ref_count == 1 and pool.num_free == 7


def test_eviction_prefers_plain_blocks_then_lru_with_tail_first():
    pool = make_pool(n=4)
    seq = pool.allocate(3)
    pool.register(seq, [1, 2, 3], [(i,) * 4 for i in range(3)], None)
    pool.free(seq)
    [plain] = pool.allocate(1)
    assert plain.hash is None, "never-hashed blocks are used before evicting cached ones"
    [victim] = pool.allocate(1)
    assert victim is seq[2], "a freed sequence's tail is evicted first"
    assert pool.lookup(3, (2,) * 4) is None and pool.lookup(1, (0,) * 4) is seq[0]


def test_events_are_gap_free_and_describe_residency():
    log = EventLog("w")
    pool = BlockPool(2, 4, log)
    a = pool.allocate(2)
    pool.register(a, [10, 11], [(1,) * 4, (2,) * 4], None)
    pool.free(a)
    pool.allocate(1)
    pool.clear_cache()
    kinds = [(e.seq, e.kind, e.hashes, e.parent) for e in log.after(0).events]
    assert kinds[0] == (1, STORED, (10, 11), None)
    assert kinds[1] == (2, REMOVED, (11,), None)
    assert kinds[2][:2] == (3, CLEARED)
    assert [e.seq for e in log.after(0).events] == [1, 2, 3]


def test_duplicate_hash_splits_stored_runs_with_right_parent():
    log = EventLog("w")
    pool = BlockPool(6, 4, log)
    first = pool.allocate(2)
    pool.register(first, [1, 2], [(0,) * 4, (1,) * 4], None)
    second = pool.allocate(3)
    pool.register(second, [1, 2, 3], [(0,) * 4, (1,) * 4, (2,) * 4], None)
    last = log.after(1).events
    assert [(e.hashes, e.parent) for e in last] == [((3,), 2)]


def test_event_log_reports_gap_when_events_dropped():
    log = EventLog("w", capacity=4)
    for i in range(10):
        log.append(STORED, (i,))
    assert log.after(0).gap
    batch = log.after(7)
    assert not batch.gap and [e.seq for e in batch.events] == [8, 9, 10]
    assert log.after(10).events == [] and not log.after(10).gap


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "reg"]), st.integers(0, 5)), max_size=60))
def test_pool_invariants_under_random_operations(ops):
    log = EventLog("w")
    pool = BlockPool(6, 2, log)
    held: list = []
    resident: set[int] = set()
    next_hash = 1
    for op, n in ops:
        if op == "alloc" and pool.can_allocate(n):
            held.extend(pool.allocate(n))
        elif op == "free" and held:
            k = min(len(held), n + 1)
            pool.free(held[:k])
            held = held[k:]
        elif op == "reg" and held:
            b = held[n % len(held)]
            pool.register([b], [next_hash], [(next_hash, 0)], None)
            next_hash += 1
        list(log.after(0).events)
        assert pool.num_free + len({b.block_id for b in held}) == pool.num_blocks
        assert pool.num_shared == sum(b.ref_count >= 2 for b in pool.blocks)
    for e in log.after(0).events:
        if e.kind == STORED:
            resident |= set(e.hashes)
        elif e.kind == REMOVED:
            resident -= set(e.hashes)
        else:
            resident.clear()
    assert resident == set(pool.resident_hashes()), "replaying events gives the pool's residency"


def test_shared_blocks_are_those_two_or_more_requests_read():
    """What a worker reports as `shared_blocks`: a prefix its requests share stays in use while
    any of them runs, so finishing one request frees only its private blocks."""
    pool = BlockPool(8, 2, EventLog("w"))
    a = pool.allocate(3)
    pool.register(a[:2], [1, 2], [(1, 1), (2, 2)], None)
    b = pool.touch_prefix([1, 2], [1, 1, 2, 2]) + pool.allocate(1)
    assert pool.num_shared == 2
    pool.hold([a[2].block_id])
    assert pool.num_shared == 3
    pool.free(a)
    assert pool.num_shared == 0 and pool.num_free == 8 - 4
    pool.free(b)
    assert pool.num_shared == 0


def test_touch_prefix_stops_at_a_hash_hit_with_other_tokens():
    """A prefix hit walks the chain like lookup + touch per block, so a 64-bit hash collision
    (same hash, other tokens) ends the hit there."""
    pool = make_pool()
    blocks = pool.allocate(3)
    pool.register(blocks, [1, 2, 3], [(1,) * 4, (2,) * 4, (3,) * 4], None)
    pool.free(blocks)
    assert pool.touch_prefix([1, 2, 3], [1] * 4 + [2] * 4 + [3] * 4) == blocks
    assert [b.ref_count for b in blocks] == [1, 1, 1] and pool.num_free == 5
    pool.free(blocks)
    hit = pool.touch_prefix([1, 2, 3], [1] * 4 + [9] * 4 + [3] * 4)
    assert hit == blocks[:1] and blocks[1].ref_count == 0 and pool.num_free == 7
    assert pool.touch_prefix([7, 1], [1] * 8) == []


def test_blocks_are_created_on_first_use_in_id_order():
    pool = make_pool(n=4)
    assert pool.blocks == [] and pool.num_free == 4
    a = pool.allocate(2)
    pool.free(a)
    b = pool.allocate(4)
    assert [x.block_id for x in b] == [2, 3, 1, 0], "never-used first, then freed ones (tail first)"
    assert pool.num_free == 0 and len(pool.blocks) == 4


def test_hold_keeps_blocks_from_reuse_until_freed():
    pool = make_pool(n=4)
    blocks = pool.allocate(2)
    held = pool.hold([b.block_id for b in blocks])
    pool.free(blocks)  # the request finishes; the exporter still holds them
    assert pool.num_free == 2
    assert {b.block_id for b in pool.allocate(2)}.isdisjoint(b.block_id for b in held)
    pool.free(held)
    assert pool.num_free == 2 and all(b.ref_count == 0 for b in held)


def test_hold_refuses_free_blocks():
    pool = make_pool(n=4)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.hold([blocks[0].block_id])
