"""The residency index keeps each worker's tiers apart (events' `medium`): a match runs over any
tier, `slow_blocks` says how much of it is off the device; snapshots and old medium-less events
(device) read the same as the events that built them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.index import ResidencyIndex
from policies import predict
from policies.api import TierCredits
from policies.kv_cost import KvCost
from policies.prefix_affinity import PrefixAffinity
from policies.slo_goodput import SloGoodput
from tests.views import fleet, req, worker
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
@given(
    st.lists(
        st.tuples(
            st.sampled_from(WORKERS),
            st.sampled_from([STORED, REMOVED, CLEARED]),
            st.sampled_from(MEDIA),
            st.lists(st.integers(1, 8), max_size=5),
        ),
        max_size=60,
    ),
    st.lists(st.integers(1, 8), min_size=1, max_size=8),
)
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
    for bad in (
        {"worker_id": "w", "seq": 1, "hashes": [], "tiers": [1]},
        {"worker_id": "w", "seq": 1},
        {"worker_id": "w", "seq": None, "hashes": []},
        {"worker_id": "w", "seq": 1, "hashes": [["x"]]},
    ):
        with pytest.raises(ValueError):
            KVSnapshot.from_json(bad)


# Tier-aware routing: a matched block is worth its tier's credit, in every policy alike


@pytest.mark.parametrize("policy", [KvCost(), PrefixAffinity(), SloGoodput()], ids=lambda p: p.name)
@pytest.mark.parametrize("host_credit, winner", [(0.5, "device"), (0.9, "host"), (1.0, "host")])
def test_a_longer_match_in_host_loses_to_a_shorter_one_on_device_when_credited_less(policy, host_credit, winner):
    """ "host" holds 40 blocks of the prompt, all in its host tier; "device" 30 on its device.
    At credit 0.5 the host match is worth 20 blocks and "device" wins; at 1.0 it is worth 40."""
    credits = TierCredits(host=host_credit)
    f = fleet(
        worker("device", matched_blocks=30, total_blocks=4096, free_blocks=4096),
        worker(
            "host", matched_blocks=40, matched_host_blocks=40, tier_credits=credits, total_blocks=4096, free_blocks=4096
        ),
    )
    r = req(64 * 16)
    route = policy.route(r, f)
    assert route.worker == winner
    assert predict.cached_tokens(r, f.workers[1]) == round(40 * host_credit) * 16
    # what the route predicts is what the worker will report: every matched block, whatever its tier
    assert route.predicted_cached_tokens == {"device": 30, "host": 40}[winner] * 16


def test_the_last_block_cut_from_a_match_is_taken_from_its_slowest_tier():
    w = worker("w", matched_blocks=4, matched_host_blocks=1, matched_disk_blocks=1, tier_credits=TierCredits(0.5, 0.25))
    assert predict.cached_tokens(req(4 * 16), w) == round((2 + 0.5) * 16), "3 usable blocks: the disk one goes"
    assert predict.cached_tokens(req(5 * 16), w) == round((2 + 0.5 + 0.25) * 16)


def test_a_host_block_saves_its_whole_prefill_and_its_copy_time_delays_only_its_own_request():
    """Copy-back at 50 GB/s of 128 KiB per token: 2.6 us a token. On an idle worker the copy of
    40 host blocks outlasts the (empty) queue and adds to the TTFT; behind a long queue it is
    hidden; the hit's compute credit is whole either way."""
    credits = TierCredits(host_gbps=50.0)
    r = req(64 * 16)
    kv = dict(kv_bytes_per_token=131072)
    idle = worker("w", matched_blocks=40, matched_host_blocks=40, tier_credits=credits, **kv)
    on_device = worker("w", matched_blocks=40, **kv)
    copy = 40 * 16 * 131072 / 50e6
    assert predict.cached_tokens(r, idle) == predict.cached_tokens(r, on_device) == 40 * 16
    assert predict.copy_back_ms(r, idle) == pytest.approx(copy)
    assert predict.ttft_ms(r, idle) - predict.ttft_ms(r, on_device) == pytest.approx(copy, rel=0.05)
    busy = dict(queued_prefill_tokens=20000, waiting=4, **kv)
    host_busy = worker("w", matched_blocks=40, matched_host_blocks=40, tier_credits=credits, **busy)
    assert predict.ttft_ms(r, host_busy) == predict.ttft_ms(r, worker("w", matched_blocks=40, **busy))


def test_a_disk_block_is_read_back_at_the_disk_rate_and_delays_only_its_own_request():
    """20 disk blocks at 2 GB/s and 20 host blocks at 50 GB/s of 128 KiB per token: both reads
    delay an idle worker's TTFT, the disk's 25 times as long a block; the compute credit is whole."""
    credits = TierCredits(host_gbps=50.0, disk_gbps=2.0)
    r = req(64 * 16)
    kv = dict(kv_bytes_per_token=131072)
    both = worker("w", matched_blocks=40, matched_host_blocks=20, matched_disk_blocks=20, tier_credits=credits, **kv)
    on_device = worker("w", matched_blocks=40, **kv)
    copy = 20 * 16 * 131072 * (1 / 50e6 + 1 / 2e6)
    assert predict.cached_tokens(r, both) == predict.cached_tokens(r, on_device) == 40 * 16
    assert predict.copy_back_ms(r, both) == pytest.approx(copy)
    assert predict.ttft_ms(r, both) - predict.ttft_ms(r, on_device) == pytest.approx(copy, rel=0.05)
