"""Properties of every built-in policy over random fleets (hypothesis), and one decision on a
64-worker fleet (the named cases: test_policies.py)."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from policies import predict
from policies.api import DECODE, MIXED, PREFILL, FleetView, RequestView, Route, WorkerView
from policies.candidates import stable_hash
from policies.prefix_affinity import PrefixAffinity
from policies.round_robin import RoundRobin
from policies.slo_goodput import SloGoodput
from tests.test_policies import PD_AWARE, STATELESS
from tests.views import COST, fleet, req, worker


# properties over random fleets

ROLES = (MIXED, PREFILL, DECODE)


@st.composite
def fleets(draw, max_workers: int = 8):
    n = draw(st.integers(0, max_workers))
    num_tokens = draw(st.integers(1, 6000))
    r = RequestView(
        request_id="r",
        num_tokens=num_tokens,
        block_hashes=tuple(draw(st.integers(0, 2**64 - 1)) for _ in range(num_tokens // 16)),
        max_tokens=draw(st.integers(1, 1024)),
        slo_ttft_ms=draw(st.none() | st.floats(1, 10_000)),
        slo_tpot_ms=draw(st.none() | st.floats(1, 500)),
    )
    workers = []
    for i in range(n):
        running = draw(st.integers(0, 300))
        workers.append(
            WorkerView(
                worker_id=f"w{i}",
                role=draw(st.sampled_from(ROLES)),
                matched_blocks=draw(st.integers(0, len(r.block_hashes))),
                waiting=draw(st.integers(0, 50)),
                running=running,
                in_flight=draw(st.integers(0, 400)),
                queued_prefill_tokens=draw(st.integers(0, 100_000)),
                kv_tokens=running * draw(st.integers(0, 4000)),
                max_batched_tokens=draw(st.sampled_from((256, 2048, 8192))),
                step_ms=draw(st.none() | st.floats(0.5, 500)),
                step_prefill_tokens=draw(st.sampled_from((0.0, 100.0, 2048.0))),
                step_prefill_ctx_products=draw(st.sampled_from((0.0, 1e6))),
                step_decode_seqs=draw(st.sampled_from((0.0, 1.0, 40.5))),
                step_decode_kv_tokens=draw(st.sampled_from((0.0, 50_000.0))),
                decode_step_ms=draw(st.none() | st.floats(0.5, 500)),
                decode_step_seqs=draw(st.sampled_from((0.0, 1.0, 40.5))),
                decode_step_kv_tokens=draw(st.sampled_from((0.0, 50_000.0))),
                cost=draw(st.none() | st.just(COST)),
                transfer_gbps=draw(st.sampled_from((0.0, 1.0, 25.0))),
                kv_bytes_per_token=draw(st.sampled_from((0, 36_864))),
            )
        )
    return r, FleetView(workers=tuple(workers))


def check_route(route: Route, f: FleetView, r: RequestView) -> None:
    roles = {w.worker_id: w.role for w in f.workers}
    if route.reject is not None:
        assert route.reject and route.worker is None and route.prefill is None
        return
    assert route.worker in roles and roles[route.worker] in (MIXED, DECODE)
    if route.prefill is not None:  # a P/D split, or a warm pair: a mixed holder ships to a mixed worker
        assert (roles[route.prefill], roles[route.worker]) in ((PREFILL, DECODE), (MIXED, MIXED))
        assert route.prefill != route.worker
    chosen = next(w for w in f.workers if w.worker_id == (route.prefill or route.worker))
    assert route.predicted_cached_tokens == predict.cached_tokens(r, chosen)  # never the last token's block


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_every_route_is_a_serving_worker_a_pd_pair_or_a_reason(case):
    r, f = case
    policies = (RoundRobin(), *(cls() for cls in STATELESS), *(cls(pd_min_uncached_tokens=1) for cls in PD_AWARE))
    roles = {w.worker_id: w.role for w in f.workers}
    for policy in policies:
        route = policy.route(r, f)
        check_route(route, f, r)
        if route.prefill is not None and roles[route.prefill] == PREFILL:
            assert isinstance(policy, PD_AWARE) and policy.pd.split(r, f)
        elif route.prefill is not None:  # a warm pair ships from the worker holding the most of the prompt
            assert isinstance(policy, SloGoodput) and policy.warmer is not None and not policy.pd.split(r, f)
            held = {w.worker_id: predict.cached_tokens(r, w) for w in f.by_role(MIXED)}
            assert held[route.prefill] == max(held.values()) > held[route.worker]
        elif not isinstance(policy, SloGoodput) and f.by_role(MIXED, DECODE):
            assert route.worker in {w.worker_id for w in f.by_role(MIXED) or f.by_role(DECODE)}


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_prefix_affinity_takes_the_longest_eligible_match_then_the_least_load(case):
    r, f = case
    workers = f.by_role(MIXED) or f.by_role(DECODE)
    if not workers:
        return
    route = PrefixAffinity().route(r, f)
    if route.prefill is not None:
        return
    bound = route.info["load_bound"]
    eligible = [w for w in workers if w.load <= bound]
    chosen = next(w for w in workers if w.worker_id == route.worker)
    assert chosen in eligible
    assert (-predict.cached_tokens(r, chosen), chosen.load) == min(
        (-predict.cached_tokens(r, w), w.load) for w in eligible
    )


def test_ties_go_by_the_stable_hash_of_the_first_block_then_the_id():
    r = req(1024)
    ws = [worker(f"w{i}") for i in range(16)] + [worker("busy", running=3)]
    tied = min(ws[:16], key=lambda w: (stable_hash(r.block_hashes[0], w.worker_id), w.worker_id))
    for cls in STATELESS:
        assert cls().route(r, fleet(*ws)).worker == tied.worker_id, cls.name


@settings(max_examples=100, deadline=None)
@given(fleets(), st.randoms(use_true_random=False))
def test_stateless_policies_agree_across_replicas_and_worker_order(case, rnd):
    r, f = case
    shuffled = list(f.workers)
    rnd.shuffle(shuffled)
    g = FleetView(workers=tuple(shuffled))
    for cls in STATELESS:
        assert cls().route(r, f) == cls().route(r, g)


@settings(max_examples=100, deadline=None)
@given(fleets())
def test_more_cache_never_raises_predicted_ttft(case):
    r, f = case
    for w in f.workers:
        if w.matched_blocks < len(r.block_hashes):
            more = WorkerView(**{**w.__dict__, "matched_blocks": w.matched_blocks + 1})
            assert predict.ttft_ms(r, more) <= predict.ttft_ms(r, w) + 1e-9


# a large fleet (how fast: `python -m bench.gateway_overhead --only decision`)


@pytest.mark.parametrize(
    "roles", ((MIXED,) * 64, (PREFILL,) * 32 + (DECODE,) * 32, (PREFILL,) * 16 + (DECODE,) * 16 + (MIXED,) * 32)
)
def test_a_64_worker_decision_names_workers_of_the_fleet(roles):
    rnd = random.Random(0)
    f = FleetView(
        workers=tuple(
            WorkerView(
                worker_id=f"w{i}",
                role=role,
                matched_blocks=rnd.randrange(200),
                running=rnd.randrange(100),
                waiting=rnd.randrange(5),
                queued_prefill_tokens=rnd.randrange(10_000),
                kv_tokens=rnd.randrange(200_000),
                cost=COST,
                kv_bytes_per_token=36_864,
            )
            for i, role in enumerate(roles)
        )
    )
    r = req(4096)
    ids = {w.worker_id for w in f.workers}
    for policy in (RoundRobin(), *(cls() for cls in STATELESS)):
        route = policy.route(r, f)
        assert route.worker in ids and route.prefill in ids | {None}, (policy.name, route.reject)
