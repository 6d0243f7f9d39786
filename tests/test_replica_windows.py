"""slo_goodput behind several gateway replicas: each decision's tally (`policies.api.Tally`)
reaches the others, so every replica's windows over recent traffic (refusals, request sizes,
a prefix's demand) count the fleet's traffic as one router's would. Pure: the tallies are
handed over here as the gateway hands over what Redis brings."""

from hypothesis import given, settings
from hypothesis import strategies as st

from policies import predict
from policies.api import FleetView, RequestView, Route, Tally
from policies.slo_goodput import SloGoodput
from tests.views import req, worker

LINK = dict(total_blocks=1024, kv_bytes_per_token=36_864, transfer_gbps=25.0)


def routed(replicas: list[SloGoodput], stream: list[tuple[int, RequestView, FleetView]], share: bool) -> list[Route]:
    """Each (replica, request, fleet) of `stream` routed at its replica; with `share`, its
    tally then counted by every other replica, at the decision's time."""
    routes = []
    for i, r, f in stream:
        route = replicas[i].route(r, f)
        assert route.tally is not None
        if share:
            for j, other in enumerate(replicas):
                if j != i:
                    other.add_tally(route.tally, f.now)
        routes.append(route)
    return routes


def first_warm(routes: list[Route]) -> int:
    return next(i for i, route in enumerate(routes) if route.prefill)


def test_two_replicas_warm_a_hot_prefix_at_the_request_one_router_would():
    """A hot prefix's requests split between two replicas: with the tallies shared, the request
    that takes the prefix's demand past `warm_load` of what its holder serves ships it to a
    second worker at the same point of the stream as one router does. Each replica counting
    only its own half never did: its window held half the demand, under the bound."""
    r = req(2176, max_tokens=512)
    holder = worker("holder", matched_blocks=128, free_blocks=500, shared_blocks=128, running=16, **LINK)
    roomy = worker("roomy", free_blocks=1024, **LINK)
    stream = [(i % 2, r, FleetView(workers=(holder, roomy), now=i * 0.1)) for i in range(120)]

    def policy() -> SloGoodput:
        return SloGoodput(routed_window_s=0, warm_load=0.8)

    one = first_warm(routed([policy()], [(0, r, f) for _, r, f in stream], share=False))
    fits, life_ms = predict.pool_batch(r, holder, alike=True)
    assert (one + 1) / 5.0 * life_ms / 1000.0 / fits > 0.8  # the demand's own point, as the single-router test
    assert first_warm(routed([policy(), policy()], stream, share=True)) == one
    assert not any(route.prefill for route in routed([policy(), policy()], stream, share=False))


def tight_fleet(now: float) -> FleetView:
    """Two workers with little pool left and queues: large requests are refused, small ones
    admitted, and what is refused moves the pool-wait safety of the decisions after it."""
    a = worker("a", total_blocks=256, free_blocks=40, running=12, in_flight=14, kv_tokens=2600, waiting=2)
    b = worker("b", total_blocks=256, free_blocks=90, running=8, in_flight=9, kv_tokens=1900, waiting=1)
    return FleetView(workers=(a, b), now=now)


requests = st.tuples(st.integers(16, 3072), st.integers(1, 512), st.floats(0.0, 0.5))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 3), st.lists(st.tuples(st.integers(0, 2), requests), min_size=1, max_size=80))
def test_replicas_that_share_their_tallies_decide_as_one_router(n, arrivals):
    """However the requests are spread over the replicas (unevenly too), replicas that count
    each other's tallies make the decisions one router makes of the whole stream: the same
    worker, refusal and predictions for every request."""
    stream, now = [], 0.0
    for k, (i, (tokens, max_tokens, gap)) in enumerate(arrivals):
        now += gap
        r = RequestView(f"r{k}", tokens, tuple(range(k * 1000, k * 1000 + tokens // 16)), max_tokens=max_tokens)
        stream.append((i % n, r, tight_fleet(now)))
    one = routed([SloGoodput(routed_window_s=0)], [(0, r, f) for _, r, f in stream], share=False)
    assert routed([SloGoodput(routed_window_s=0) for _ in range(n)], stream, share=True) == one


def test_the_tight_fleet_refuses_some_and_admits_others():
    """`tight_fleet` tells the property above something: its decisions differ by size and
    by what was refused before."""
    policy = SloGoodput(routed_window_s=0)
    sizes = [64, 3000, 128, 2800, 256, 3072, 96, 2900] * 8
    routes = [
        policy.route(
            RequestView(f"r{k}", n, tuple(range(k * 1000, k * 1000 + n // 16)), max_tokens=256), tight_fleet(k * 0.05)
        )
        for k, n in enumerate(sizes)
    ]
    refused = [r.reject is not None for r in routes]
    assert any(refused) and not all(refused)
    assert policy.safety > 1.0


def test_a_replica_that_only_hears_the_others_holds_no_more_than_its_windows():
    """A replica the balancer sends nothing (drained, or sorted out of a kind of traffic) still
    hears every other replica's tallies and routed prompts: its windows drop what ages out as
    they arrive, not at its next decision, which may never come."""
    policy = SloGoodput(routed_window_s=1.0, refusal_window_s=5.0, warm_window_s=5.0)
    w = worker("w0", total_blocks=1024)
    for k in range(4000):  # 40 s at 100 decisions a second
        now = k * 0.01
        policy.add_tally(Tally(k % 4 == 0, 100 + k, k), now)
        policy.observe(RequestView(f"r{k}", 65, (4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3)), w, now)
    assert len(policy.refusals.decisions) <= 501 and abs(policy.refusals.share(now) - 0.25) < 0.01
    assert len(policy.routed.sent) <= 101 and len(policy.routed.first) <= 4 * 101
    assert policy.warmer is not None and len(policy.warmer.requests) <= 501
    assert len(policy.footprints.recent) <= policy.footprints.window
