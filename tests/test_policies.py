"""The built-in routing policies and the policy registry (predictions: test_predict.py;
properties over random fleets: test_policy_properties.py)."""

from importlib.metadata import EntryPoint

import pytest

from gateway.worker_view import with_fields
from policies import predict, registry, slo_goodput
from policies.api import DECODE, PREFILL, FleetView, Policy, Route
from policies.kv_cost import KvCost
from policies.least_load import LeastLoad
from policies.pd import Pair, PdDecider
from policies.prefix_affinity import PrefixAffinity
from policies.registry import BUILTIN_POLICIES, load_policy
from policies.round_robin import RoundRobin
from policies.slo_goodput import SloGoodput
from tests.views import fleet, req, worker
from workers.kv.cost_model import CostModel

STATELESS = (LeastLoad, PrefixAffinity, KvCost, SloGoodput)
PD_AWARE = (PrefixAffinity, KvCost, SloGoodput)


# P/D-unaware policies


def test_round_robin_cycles_in_worker_id_order_over_serving_workers():
    f = fleet(worker("c"), worker("p", role=PREFILL), worker("a"), worker("d", role=DECODE))
    rr = RoundRobin()
    assert [rr.route(req(), f).worker for _ in range(4)] == ["a", "c", "a", "c"]


def test_decode_workers_serve_alone_only_without_mixed_ones():
    f = fleet(worker("p", role=PREFILL), worker("d1", role=DECODE), worker("d2", role=DECODE))
    for policy in (RoundRobin(), *(cls() for cls in STATELESS)):
        assert policy.route(req(), f).worker in ("d1", "d2")


@pytest.mark.parametrize("cls", (RoundRobin, *STATELESS))
def test_no_serving_workers_is_a_rejection(cls):
    for f in (fleet(), fleet(worker("p", role=PREFILL))):
        assert cls().route(req(), f) == Route(reject="no healthy workers")


def test_least_load_picks_the_least_loaded():
    f = fleet(worker("a", running=5), worker("b", waiting=1, running=1), worker("c", in_flight=4))
    assert LeastLoad().route(req(), f).worker == "b"


def test_prefix_affinity_follows_the_longest_match():
    f = fleet(
        worker("a", matched_blocks=10, running=2), worker("b", matched_blocks=30, running=3), worker("c", running=0)
    )
    route = PrefixAffinity().route(req(), f)
    assert route.worker == "b" and route.predicted_cached_tokens == 30 * 16


def test_prefix_affinity_skips_only_the_overloaded_candidate():
    f = fleet(
        worker("hot", matched_blocks=40, running=30),
        worker("warm", matched_blocks=20, running=5),
        worker("cold", running=2),
    )
    assert PrefixAffinity(slack_abs=4, slack_rel=0.5).route(req(), f).worker == "warm"
    assert PrefixAffinity(slack_abs=40).route(req(), f).worker == "hot"


def test_prefix_affinity_without_a_match_takes_the_least_loaded():
    f = fleet(worker("a", running=3), worker("b", running=1), worker("c", running=2))
    assert PrefixAffinity().route(req(), f).worker == "b"


def test_kv_cost_weighs_cache_hits_against_queued_prefill():
    r = req(4096)
    f = fleet(worker("hit", matched_blocks=200, queued_prefill_tokens=1000, waiting=1), worker("idle"))
    assert KvCost().route(r, f).worker == "hit"
    f = fleet(worker("hit", matched_blocks=200, queued_prefill_tokens=8000, waiting=3), worker("idle"))
    assert KvCost().route(r, f).worker == "idle"
    f = fleet(worker("a", matched_blocks=10, running=20), worker("b", matched_blocks=10))
    assert KvCost(alpha=64).route(r, f).worker == "b"
    assert KvCost().route(r, f).info["cost"] == 4096 - 160


# SLO goodput


def test_slo_goodput_picks_the_most_headroom_and_fills_predictions():
    r = req(2048)
    f = fleet(
        worker("busy", running=100, kv_tokens=200_000, queued_prefill_tokens=6000, waiting=3),
        worker("free", running=4, kv_tokens=4000),
    )
    route = SloGoodput().route(r, f)
    assert route.worker == "free" and route.prefill is None
    assert route.predicted_ttft_ms == pytest.approx(predict.ttft_ms(r, f.workers[1]))
    assert route.predicted_tpot_ms == pytest.approx(predict.tpot_ms(r, f.workers[1]))
    assert 0 <= route.info["headroom"] <= 1


def test_slo_goodput_keeps_a_long_hit_on_its_holder_until_the_load_outweighs_it():
    """A hit is worth the prefill it saves, as a share of the TTFT SLO: a 3840-token hit keeps
    the request on a busier holder, until that holder's lost headroom outweighs it."""
    r = req(4096, slo_ttft_ms=1000, slo_tpot_ms=50)
    idle = worker("idle")
    for running, expected in ((8, "holder"), (30, "holder"), (90, "idle")):
        holder = worker("holder", matched_blocks=240, running=running, kv_tokens=running * 2000)
        route = SloGoodput().route(r, fleet(holder, idle))
        assert route.worker == expected, running
    holder = worker("holder", matched_blocks=240, running=8, kv_tokens=16_000)
    assert SloGoodput().route(r, fleet(holder, idle)).predicted_cached_tokens == 240 * 16
    swamped = with_fields(holder, queued_prefill_tokens=40_000, waiting=20)
    assert slo_goodput._headroom(*predict.ttft_tpot_ms(r, swamped), 1000, 50) < 0
    assert SloGoodput().route(r, fleet(swamped, idle)).worker == "idle"


def test_slo_goodput_spreads_new_sessions_whose_hit_is_a_short_shared_prompt():
    """A 512-token system prompt saves little: a new session goes to the idle worker as soon as
    the holder is a few requests busier, so every worker warms up."""
    r = req(640, slo_ttft_ms=1000, slo_tpot_ms=50)
    busy = worker("holder", matched_blocks=32, running=8, kv_tokens=8000)
    assert SloGoodput().route(r, fleet(busy, worker("idle"))).worker == "idle"
    quiet = worker("holder", matched_blocks=32, running=1, kv_tokens=1000)
    assert SloGoodput().route(r, fleet(quiet, worker("idle"))).worker == "holder"


def test_slo_goodput_waits_for_a_full_pool_that_frees_in_time_and_refuses_one_that_does_not():
    """A full pool is a wait, not a refusal: the holder's running requests end and free their
    blocks well within the TTFT SLO, so it keeps the request rather than copy the prefix into
    another full pool (refusing it, slo_goodput shed a third of the shared-prefix requests
    full pools served within SLO). A pool its shared prefixes pin frees little as its requests
    end: the request goes where there is room, and with none it is rejected."""
    fast = CostModel.load("bench/profiles/h200-llama8b-kvgate-eager.json")
    r = req(2176, max_tokens=128, slo_ttft_ms=2000, slo_tpot_ms=100)
    pool = dict(cost=fast, total_blocks=1024, free_blocks=10, running=30, kv_tokens=30 * 2300, in_flight=36)
    full = worker("full", matched_blocks=128, shared_blocks=128, waiting=1, **pool)
    other = worker("other", shared_blocks=128, **pool)
    route = SloGoodput().route(r, fleet(full, other))
    assert route.worker == "full" and 0 < predict.pool_queue_wait_ms(r, full, 1.0) < route.predicted_ttft_ms < 2000
    pinned = with_fields(full, shared_blocks=1000)
    roomy = worker("roomy", running=10, total_blocks=1024, free_blocks=900, cost=fast)
    assert SloGoodput().route(r, fleet(pinned, other)).worker is None  # a copy waits its turn too
    assert SloGoodput().route(r, fleet(pinned, other, roomy)).worker == "roomy"
    route = SloGoodput().route(r, fleet(pinned))
    assert route.worker is None and route.reject.startswith("no worker meets the SLOs")


def test_slo_goodput_keeps_a_prefix_where_a_copy_would_crowd_another_pool():
    """On a fast GPU a 2048-token prefix is ~20 ms of prefill, next to nothing against a 2 s
    TTFT SLO, but a second copy of it takes a large share of another worker's free KV pool:
    with pools too small for every prefix, copies crowd out running requests and the pool
    check rejects requests that would have met their SLOs. So the request stays on the
    holder though a quieter worker has more headroom, and goes there when the holder's free
    pool is what the copy would take."""
    fast = CostModel.load("bench/profiles/h200-llama8b-kvgate-eager.json")
    r = req(2176, slo_ttft_ms=2000, slo_tpot_ms=100)
    pool = dict(cost=fast, total_blocks=1024)
    holder = worker("holder", matched_blocks=128, running=24, kv_tokens=24 * 2300, free_blocks=300, **pool)
    quiet = worker("quiet", running=8, kv_tokens=8 * 2300, free_blocks=400, **pool)
    assert SloGoodput().route(r, fleet(holder, quiet)).worker == "holder"
    assert predict.pool_share(r, holder) < predict.pool_share(r, quiet)
    roomy = with_fields(quiet, free_blocks=1000)
    crowded = with_fields(holder, free_blocks=20)
    assert SloGoodput().route(r, fleet(crowded, roomy)).worker == "quiet"


def test_slo_goodput_times_the_pools_of_a_pd_pair():
    """A P/D pair's decode worker holds the request to its end, so it waits its turn in D's pool
    (warm pairs without it copied hot prefixes into full pools); a prefill worker P holds the
    prompt only while it computes it, but a warm pair's P, a mixed worker, admits its prefill
    in turn with its own requests."""
    r = req(2048, max_tokens=128)
    pinned = worker("p", running=20, kv_tokens=40_000, total_blocks=1024, free_blocks=0, shared_blocks=950)
    prefill = with_fields(pinned, role=PREFILL)
    roomy = worker("d", total_blocks=1024, free_blocks=1024)
    assert SloGoodput().pair(r, Pair(prefill, roomy, 100.0, 20.0))[0] == 100.0
    ttft = SloGoodput().pair(r, Pair(pinned, roomy, 100.0, 20.0))[0]
    assert ttft == pytest.approx(100.0 + predict.pool_queue_wait_ms(r, pinned, 1.0)) and ttft > 1000
    ttft = SloGoodput().pair(r, Pair(roomy, pinned, 100.0, 20.0))[0]
    assert ttft == pytest.approx(100.0 + predict.pool_queue_wait_ms(r, pinned, 1.0)) and ttft > 1000


def test_slo_goodput_headroom_is_the_tighter_of_the_two_slos():
    r = req(2048, slo_ttft_ms=1000, slo_tpot_ms=20)
    # "quick" starts fast but decodes a big batch; "steady" queues a little but decodes lightly.
    quick = worker("quick", running=40, kv_tokens=40_000)
    steady = worker("steady", waiting=1, queued_prefill_tokens=2048)
    assert predict.ttft_ms(r, quick) < predict.ttft_ms(r, steady)
    assert SloGoodput().route(r, fleet(quick, steady)).worker == "steady"


def test_slo_goodput_rejects_with_a_reason_when_no_worker_can_meet_the_slo():
    r = req(8192, slo_ttft_ms=50)
    route = SloGoodput().route(r, fleet(worker("a"), worker("b", running=10)))
    assert route.worker is None and "ttft" in route.reject and "50 ms" in route.reject


def test_slo_goodput_uses_its_defaults_when_the_request_has_none():
    r, f = req(8192), fleet(worker("a"))
    assert SloGoodput().route(r, f).worker == "a"
    assert SloGoodput(ttft_ms=10).route(r, f).reject
    assert SloGoodput(ttft_ms=10).route(req(8192, slo_ttft_ms=5000), f).worker == "a"


def pd_fleet(**mixed_kw) -> FleetView:
    kv = dict(kv_bytes_per_token=100_000, transfer_gbps=50.0)
    return fleet(
        worker("p-busy", role=PREFILL, queued_prefill_tokens=16_000, waiting=4, **kv),
        worker("p-idle", role=PREFILL, **kv),
        worker("d-busy", role=DECODE, running=200, kv_tokens=400_000, **kv),
        worker("d-idle", role=DECODE, running=8, kv_tokens=8000, **kv),
        *([worker("m", **mixed_kw)] if mixed_kw else []),
    )


def test_slo_goodput_chooses_the_pd_pair_jointly():
    r = req(4096, slo_tpot_ms=60)
    route = SloGoodput().route(r, pd_fleet())
    assert (route.prefill, route.worker) == ("p-idle", "d-idle")
    p, d = pd_fleet().workers[1], pd_fleet().workers[3]
    assert route.predicted_ttft_ms == pytest.approx(predict.pd_ttft_ms(r, p, d))
    assert route.predicted_tpot_ms == pytest.approx(predict.tpot_ms(r, d))


def test_pair_cached_tokens_are_the_prefill_workers():
    kv = dict(kv_bytes_per_token=1000)
    f = fleet(worker("p", role=PREFILL, matched_blocks=100, **kv), worker("d", role=DECODE, **kv))
    route = SloGoodput(pd_min_uncached_tokens=1).route(req(4096), f)
    assert (route.prefill, route.worker, route.predicted_cached_tokens) == ("p", "d", 1600)


def test_pair_prefers_the_decode_worker_that_needs_fewer_blocks_moved():
    kv = dict(kv_bytes_per_token=1_000_000, transfer_gbps=1.0)
    f = fleet(
        worker("p", role=PREFILL, **kv),
        worker("d-cold", role=DECODE, **kv),
        worker("d-warm", role=DECODE, matched_blocks=200, **kv),
    )
    route = SloGoodput(pd_min_uncached_tokens=1).route(req(4096), f)
    assert (route.prefill, route.worker) == ("p", "d-warm")


def test_short_uncached_prompts_are_not_disaggregated():
    f = pd_fleet()
    route = SloGoodput(pd_min_uncached_tokens=512).route(req(256), f)
    assert route.prefill is None and route.worker == "d-idle"
    warm = fleet(*f.workers[:3], worker("d-idle", role=DECODE, matched_blocks=250))
    route = SloGoodput(pd_min_uncached_tokens=512).route(req(4096), warm)
    assert route.prefill is None and route.worker == "d-idle"


def test_mixed_workers_compete_with_pairs():
    r = req(4096)
    assert SloGoodput().route(r, pd_fleet(matched_blocks=256)).worker == "m"
    busy = dict(running=200, kv_tokens=400_000, queued_prefill_tokens=30_000, waiting=8)
    assert SloGoodput().route(r, pd_fleet(**busy)).prefill == "p-idle"


def test_slo_goodput_rejects_when_no_pair_meets_the_slo():
    route = SloGoodput().route(req(4096, slo_ttft_ms=30), pd_fleet())
    assert route.worker is None and "P/D pair" in route.reject


@pytest.mark.parametrize("cls", (PrefixAffinity, KvCost))
def test_cache_policies_disaggregate_through_the_shared_decider(cls):
    """prefix_affinity and kv_cost split a long uncached prompt over the pair predicted to
    answer first, and keep a short one (or one a decode worker holds) on one worker."""
    f = fleet(
        worker("p0", role=PREFILL),
        worker("p1", role=PREFILL, running=50, kv_tokens=50_000),
        worker("d0", role=DECODE),
        worker("d1", role=DECODE, running=80, kv_tokens=80_000),
    )
    route = cls(pd_min_uncached_tokens=1024).route(req(4096), f)
    assert (route.prefill, route.worker) == ("p0", "d0")
    pair = PdDecider(1024).best_pair(req(4096), f)
    assert route == pair.route(req(4096)) and route.predicted_ttft_ms == pair.ttft_ms
    assert cls(pd_min_uncached_tokens=1024).route(req(512), f).prefill is None
    warm = fleet(*f.workers[:2], with_fields(f.workers[2], matched_blocks=250), f.workers[3])
    assert cls(pd_min_uncached_tokens=1024).route(req(4096), warm).prefill is None
    assert PdDecider(1024).best_pair(req(4096), fleet(worker("m"), worker("d", role=DECODE))) is None


@pytest.mark.parametrize("cls", (PrefixAffinity, KvCost, SloGoodput))
def test_a_request_for_several_sequences_is_never_split(cls):
    """A KV handoff carries one sequence: a request with n > 1 or several prompts stays on one
    worker where one of a single sequence would be split."""
    f = pd_fleet()
    assert cls(pd_min_uncached_tokens=512).route(req(4096), f).prefill is not None
    route = cls(pd_min_uncached_tokens=512).route(req(4096, choices=2), f)
    assert route.prefill is None and route.worker is not None
    assert PdDecider(512).warm_pairs(req(4096, choices=2), f.workers) == []


def test_a_holder_that_cannot_take_a_request_warms_a_worker_that_would_recompute_too_slowly():
    """A holder whose decode batch would miss the TPOT SLO but which admits at once ships the
    prefix to the worker with room (a pair of two mixed workers) where that worker's cold
    prefill would miss the TTFT SLO; `warm_prefixes=False` finds no worker. A holder whose
    pool is full admits the pair's prefill only in its turn, so there the roomy worker
    recomputes (in the simulator such pairs took ~1 s where a cold copy took 21 ms); a holder
    that can take the request keeps it."""
    r = req(4096, slo_ttft_ms=300, slo_tpot_ms=40)
    link = dict(total_blocks=4096, kv_bytes_per_token=36_864, transfer_gbps=25.0)
    busy = worker("holder", matched_blocks=250, free_blocks=2048, running=120, kv_tokens=120 * 4200, **link)
    roomy = worker("roomy", free_blocks=4096, **link)
    assert predict.tpot_ms(r, busy) > 40 and predict.ttft_ms(r, roomy) > 300
    route = SloGoodput().route(r, fleet(busy, roomy))
    assert (route.prefill, route.worker) == ("holder", "roomy")
    assert route.predicted_cached_tokens == 250 * 16
    assert SloGoodput(warm_prefixes=False).route(r, fleet(busy, roomy)).reject
    full = with_fields(busy, free_blocks=0, running=80, kv_tokens=80 * 4200, in_flight=120, waiting=40)
    slow = req(4096, slo_ttft_ms=1000, slo_tpot_ms=50)
    assert SloGoodput().route(slow, fleet(full, roomy)) == Route(
        worker="roomy",
        predicted_cached_tokens=0,
        predicted_ttft_ms=predict.ttft_ms(slow, roomy),
        predicted_tpot_ms=predict.tpot_ms(slow, roomy),
        info=SloGoodput().route(slow, fleet(full, roomy)).info,
    )
    ok = with_fields(busy, running=0, kv_tokens=0)
    assert SloGoodput().route(r, fleet(ok, roomy)).worker == "holder"


def test_a_hot_prefix_warms_a_second_worker_before_its_holder_misses():
    """A holder predicted to meet the SLOs keeps its prefix's requests while their demand is
    light; the request whose arrival takes the prefix's demand (requests in the last 5 s x a
    request's life on the holder) past `warm_load` of what the holder's pool holds ships the
    prefix to a worker with room by KV import, ahead of any predicted miss. A predicted miss
    was the only trigger before: the holder kept every request. The demand expires with its
    window."""
    r = req(2176, max_tokens=512)
    link = dict(total_blocks=1024, kv_bytes_per_token=36_864, transfer_gbps=25.0)
    holder = worker("holder", matched_blocks=128, free_blocks=500, shared_blocks=128, running=16, **link)
    roomy = worker("roomy", free_blocks=1024, **link)
    load = 0.8
    policy = SloGoodput(routed_window_s=0, warm_load=load)
    fits, life_ms = predict.pool_batch(r, holder, alike=True)
    routes = [policy.route(r, FleetView(workers=(holder, roomy), now=i * 0.1)) for i in range(40)]
    first = next(i for i, route in enumerate(routes) if route.prefill)
    assert (first + 1) / 5.0 * life_ms / 1000.0 / fits > load >= first / 5.0 * life_ms / 1000.0 / fits
    assert {route.worker for route in routes[:first]} == {"holder"}
    assert (routes[first].prefill, routes[first].worker) == ("holder", "roomy")
    assert routes[first].predicted_cached_tokens == 128 * 16
    assert SloGoodput(warm_prefixes=False, routed_window_s=0).route(r, fleet(holder, roomy)).worker == "holder"
    assert policy.route(r, FleetView(workers=(holder, roomy), now=20.0)).worker == "holder"


def test_unreachable_decode_workers_are_never_paired():
    f = fleet(
        worker("p", role=PREFILL, kv_bytes_per_token=1000, transfer_gbps=0.0),
        worker("d", role=DECODE, kv_bytes_per_token=1000),
    )
    assert SloGoodput().route(req(4096), f).reject


# registry


def test_builtins_load_by_name_with_constructor_arguments():
    assert set(BUILTIN_POLICIES) == {"round_robin", "least_load", "prefix_affinity", "kv_cost", "slo_goodput"}
    for name in BUILTIN_POLICIES:
        policy = load_policy(name)
        assert isinstance(policy, Policy) and policy.name == name
    assert load_policy("slo_goodput", ttft_ms=123).ttft_ms == 123


def test_load_by_module_and_class():
    assert isinstance(load_policy("policies.kv_cost:KvCost", alpha=3), KvCost)


def test_load_by_file_path(tmp_path):
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(
        "from policies.api import Route\n"
        "class First:\n"
        "    name = 'first'\n"
        "    def __init__(self, tag='x'):\n"
        "        self.tag = tag\n"
        "    def route(self, req, fleet):\n"
        "        return Route(worker=fleet.workers[0].worker_id)\n"
    )
    policy = load_policy(f"{plugin}:First", tag="y")
    assert policy.name == "first" and policy.tag == "y"
    assert type(load_policy(f"{plugin}:First")) is type(policy)
    assert policy.route(req(), fleet(worker("a"))).worker == "a"


def test_load_by_entry_point(monkeypatch):
    ep = EntryPoint(name="cheap", value="policies.kv_cost:KvCost", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == ep.group else [])
    assert isinstance(load_policy("cheap"), KvCost)


def test_unknown_policies_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="round_robin, least_load"):
        load_policy("fastest")
    with pytest.raises(ModuleNotFoundError):
        load_policy("no_such_module:Policy")
    with pytest.raises(ValueError, match="no attribute"):
        load_policy("policies.kv_cost:Nope")
    with pytest.raises(ValueError, match="does not exist"):
        load_policy(f"{tmp_path}/missing.py:Policy")
    with pytest.raises(TypeError, match="route"):
        load_policy("collections:OrderedDict")
