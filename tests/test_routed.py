"""The routed memory (policies/routed.py): what a router sent where, before the index shows it."""

from dataclasses import replace

import pytest

from gateway.index import ResidencyIndex
from gateway.worker_view import with_fields
from policies.api import FleetView, Observer
from policies.prefix_affinity import PrefixAffinity
from policies.slo_goodput import SloGoodput
from tests.views import fleet, req, worker
from workers.kv.events import CLEARED, STORED, EventBatch, KVEvent


def two(now: float, epoch_b: int = 0, load_b: int = 0) -> FleetView:
    """Two idle workers; `b` is the less loaded one unless `load_b` says otherwise."""
    a = worker("a", running=1, total_blocks=4096, free_blocks=4000)
    b = worker("b", running=load_b, total_blocks=4096, free_blocks=4000, residency_epoch=epoch_b)
    return replace(fleet(a, b), now=now)


@pytest.mark.parametrize("policy", [PrefixAffinity, SloGoodput])
def test_a_prefix_follows_its_first_request_before_the_index_shows_it(policy):
    p = policy()
    r = req(2048, slo_ttft_ms=2000, slo_tpot_ms=100)
    first = p.route(r, two(0.0))
    assert first.worker == "b"
    # b is busier now, and nothing is in the index yet: the memory keeps the prefix together,
    # while the prediction stays the index's (nothing is known to be cached)
    again = p.route(r, two(0.1, load_b=3))
    assert again.worker == "b" and again.predicted_cached_tokens == 0


def test_the_memory_ends_with_its_window_and_with_the_workers_cache():
    p = PrefixAffinity()
    r = req(2048)
    assert p.route(r, two(0.0)).worker == "b"
    assert p.route(r, two(0.5, load_b=3)).worker == "b", "remembered"
    assert p.route(r, two(2.0, load_b=3)).worker == "a", "forgotten after the window"
    assert p.route(r, two(3.1)).worker == "b", "a new prefix, to the least loaded"
    assert p.route(r, two(3.5, epoch_b=1)).worker == "a", "b's cache was cleared since: not a hit there"
    assert p.route(r, two(3.6)).worker == "b", "the same memory, b's residency unchanged"


def test_the_index_moves_a_workers_epoch_when_it_replaces_its_residency():
    index = ResidencyIndex()
    index.reset("w", [], 0)
    start = index.epoch("w")
    index.apply(EventBatch("w", [KVEvent(1, STORED, (1, 2))], 1))
    assert index.epoch("w") == start, "events that add or remove blocks do not move it"
    index.apply(EventBatch("w", [KVEvent(2, CLEARED)], 2))
    assert index.epoch("w") == start + 1
    index.drop("w")
    assert index.epoch("w") == start + 2
    view = with_fields(worker("w"), residency_epoch=index.epoch("w"))
    assert view.residency_epoch == start + 2


@pytest.mark.parametrize("policy", [PrefixAffinity, SloGoodput])
def test_a_prefix_another_replica_sent_follows_it_here_too(policy):
    """What another replica routed (gateway.shared_ledger's `routed` notes) counts as this
    replica's own sends do, until the index shows it."""
    p = policy()
    r = req(2048, slo_ttft_ms=2000, slo_tpot_ms=100)
    assert isinstance(p, Observer)
    busy = two(0.1, load_b=3)
    assert p.route(r, busy).worker == "a", "a new prefix goes to the less loaded worker"
    q = policy()
    q.observe(r, busy.workers[1], 0.0)  # the other replica sent it to b
    assert q.route(r, busy).worker == "b"
