"""The residency index keeps each worker's tiers apart (events' `medium`): a match runs over any
tier, `slow_blocks` says how much of it is off the device; snapshots and old medium-less events
(device) read the same as the events that built them."""
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.index import ResidencyIndex
from workers.kv.events import CLEARED, DEVICE, DISK, HOST, MEDIA, REMOVED, STORED, EventBatch, KVEvent, KVSnapshot

WORKERS = ("a", "b", "c")


def brute(tiers: dict[str, dict[str, set[int]]], chain: list[int]) -> tuple[dict, dict]:
    matches, slow = {}, {}
    for wid, t in tiers.items():
        n = 0
        while n < len(chain) and any(chain[n] in t[m] for m in MEDIA):
            n += 1
        if n:
            matches[wid] = n
            off = [h for h in chain[:n] if h not in t[DEVICE]]
            host = sum(1 for h in off if h in t[HOST])
            if off:
                slow[wid] = (host, len(off) - host)
    return matches, slow


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(WORKERS), st.sampled_from([STORED, REMOVED, CLEARED]),
                          st.sampled_from(MEDIA), st.lists(st.integers(1, 8), max_size=5)), max_size=60),
       st.lists(st.integers(1, 8), min_size=1, max_size=8))
def test_tiered_match_equals_brute_force(events, chain):
    index = ResidencyIndex()
    tiers = {w: {m: set() for m in MEDIA} for w in WORKERS}
    seq = dict.fromkeys(WORKERS, 0)
    for w in WORKERS:
        index.reset(w, [], 0)
    for wid, kind, medium, hashes in events:
        seq[wid] += 1
        ev = KVEvent(seq[wid], kind, tuple(hashes), medium=medium)
        assert index.apply(EventBatch(wid, [ev], seq[wid])) is None
        if kind == CLEARED:
            tiers[wid] = {m: set() for m in MEDIA}
        elif kind == STORED:
            tiers[wid][medium] |= set(hashes)
        else:
            tiers[wid][medium] -= set(hashes)
    matches = index.match(chain)
    assert (matches, index.slow_blocks(chain, matches)) == brute(tiers, chain)
    for w in WORKERS:
        assert index.num_blocks(w, HOST) == len(tiers[w][HOST])
    copy = ResidencyIndex()
    for w in WORKERS:
        copy.reset(w, tiers[w][DEVICE], seq[w], {m: tiers[w][m] for m in (HOST, DISK)})
    assert copy.match(chain) == matches and copy.slow_blocks(chain, matches) == index.slow_blocks(chain, matches)
    for w in WORKERS:
        index.drop(w)
    assert index.match(chain) == {} and index.num_blocks() == 0


def test_an_event_without_a_medium_is_a_device_event_and_snapshots_round_trip():
    ev = KVEvent.from_json({"seq": 1, "kind": STORED, "hashes": [5]})
    assert ev.medium == DEVICE and KVEvent.from_json(ev.to_json()) == ev
    snap = KVSnapshot("w", 3, [1, 2], {HOST: [4]})
    assert KVSnapshot.from_json(snap.to_json()) == snap
    assert KVSnapshot.from_json({"worker_id": "w", "seq": 1, "hashes": [1]}).tiers == {}
    assert KVSnapshot.from_json({"worker_id": "w", "seq": 1, "hashes": [], "tiers": {"tape": [1]}}).tiers == {}
