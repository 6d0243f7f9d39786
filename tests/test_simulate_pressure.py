"""Routing under pressure, in the simulator: 4 workers with the measured H200 Llama-8B profile
and a KV pool (1024 blocks, 16k tokens) smaller than every workload's working set.

Every policy that follows the cache must still use the whole fleet once the load warrants it,
on each workload shape; slo_goodput must not collapse where the cache-blind baseline holds,
and past capacity it must shed what it predicts will miss so goodput holds."""

from collections import Counter

import pytest

from bench.fleet_sim import FleetConfig, FleetSim
from bench.report import summarize
from bench.sim_worker import SimConfig
from bench.workloads import WorkloadConfig, generate
from policies.registry import load_policy
from workers.kv.cost_model import CostModel

COST = CostModel.load("bench/profiles/h200-llama8b-kvgate-eager.json")
SLO = (2000.0, 100.0)
WORKERS = 4
SHAPES = ("multi-turn", "shared-prefix", "long-doc-qa", "skewed")
AFFINITY = ("prefix_affinity", "kv_cost", "slo_goodput")


def simulate(
    policy: str, workload: str, rate: float, blocks: int = 1024, duration: float = 20.0, **kwargs
) -> list[dict]:
    fleet = FleetConfig(
        workers=WORKERS,
        sim=SimConfig(num_blocks=blocks),
        cost=COST,
        views_with_cost=True,
        slo_ttft_ms=SLO[0],
        slo_tpot_ms=SLO[1],
    )
    wl = WorkloadConfig(name=workload, rate=rate, duration_s=duration, seed=5)
    return FleetSim(load_policy(policy, **kwargs), fleet).run(generate(wl), duration)


def good_rps(records: list[dict], rate: float) -> float:
    """Requests per second that met both SLOs (rejections count as misses)."""
    return summarize(records, *SLO)["slo_attainment"] * rate


@pytest.mark.parametrize("workload", SHAPES)
@pytest.mark.parametrize("policy", AFFINITY)
def test_every_worker_serves_once_the_load_warrants_it(policy, workload):
    """At 15 req/s one worker cannot hold the working set: hot prefixes may concentrate, but
    no worker is left idle (a fair share is a quarter; each must take at least a tenth)."""
    records = simulate(policy, workload, 15.0)
    served = Counter(r["worker"] for r in records if r["worker"] is not None)
    assert len(served) == WORKERS, served
    assert min(served.values()) >= 0.1 * len(records), served


def test_multi_turn_new_sessions_spread_even_while_the_holders_keep_up():
    """The collapse the issue saw: with a pool that two workers' worth of sessions overflows,
    slo_goodput kept every new session on the two workers that held the system prompt."""
    records = simulate("slo_goodput", "multi-turn", 13.0, blocks=1536)
    served = Counter(r["worker"] for r in records if r["worker"] is not None)
    assert len(served) == WORKERS and min(served.values()) >= 0.15 * len(records), served
    assert summarize(records, *SLO)["slo_attainment"] >= 0.95


def test_multi_turn_past_capacity_sheds_the_longest_turns_and_serves_the_rest():
    """Multi-turn is bound by the KV pools (every miss a TTFT miss, waiting for blocks; a
    session's history rarely outlives its 5 s think time in a 1024-block pool): what goodput
    there is comes from refusing the requests that would wait past their SLO, which are the
    late turns, whose history holds several times a first turn's blocks. At 25 req/s round
    robin admits everything and 0.41 meet their SLOs; slo_goodput refuses 73 of 470, prompts
    of 2278 tokens on average against 1362 admitted, and every admitted one meets them."""
    rr = summarize(simulate("round_robin", "multi-turn", 25.0), *SLO)["slo_attainment"]
    records = simulate("slo_goodput", "multi-turn", 25.0)
    refused = [r["prompt_tokens"] for r in records if r["worker"] is None]
    admitted = [r for r in records if r["worker"] is not None]
    assert refused and sum(refused) / len(refused) >= 1.4 * sum(r["prompt_tokens"] for r in admitted) / len(admitted)
    assert summarize(admitted, *SLO)["slo_attainment"] >= 0.97
    assert summarize(records, *SLO)["slo_attainment"] >= 1.5 * rr


def test_multi_turn_at_capacity_admits_what_its_pools_serve_in_time():
    """At capacity the pool wait scaled by its overload factor refused requests whose turn
    came within their SLO (multi-turn at 19 req/s: 28 refused, 0.923); scaled by the router's
    recent refusals, it waits about as predicted there (14 refused, 0.961) and is still
    doubled at 2x and 5x (the overload test above)."""
    records = simulate("slo_goodput", "multi-turn", 19.0)
    assert summarize(records, *SLO)["slo_attainment"] >= 0.95
    assert sum(r["worker"] is None for r in records) <= 20


@pytest.mark.parametrize("workload", SHAPES)
def test_slo_goodput_holds_where_round_robin_does(workload):
    """At a load round robin serves within SLO, slo_goodput does too (it lost half the fleet
    on multi-turn: 0.28 attainment where round robin held 1.00)."""
    rr = summarize(simulate("round_robin", workload, 10.0), *SLO)["slo_attainment"]
    slo = summarize(simulate("slo_goodput", workload, 10.0), *SLO)["slo_attainment"]
    assert slo >= min(rr, 0.95), (slo, rr)


def test_multi_turn_the_ledger_admits_what_the_polled_view_refused():
    """At 21 req/s (1.3x what round robin and both peers sustain on the real fleet) the polled
    pool wait refuses 34 of 394 requests (0.909 meet their SLOs); slo_goodput's ledger of what
    it has in flight (`policies.ledger`: how far each request has got, from its stream) sees the
    pools turn over sooner and refuses the largest first: 22 (0.944), and the admitted still
    meet their SLOs."""
    on = simulate("slo_goodput", "multi-turn", 21.0)
    off = simulate("slo_goodput", "multi-turn", 21.0, ledger_wait=False)
    assert summarize(on, *SLO)["slo_attainment"] >= 0.93
    assert summarize(on, *SLO)["slo_attainment"] > summarize(off, *SLO)["slo_attainment"]
    refused = [r["prompt_tokens"] for r in on if r["worker"] is None]
    admitted = [r for r in on if r["worker"] is not None]
    assert summarize(admitted, *SLO)["slo_attainment"] >= 0.99
    assert sum(refused) / len(refused) >= 1.4 * sum(r["prompt_tokens"] for r in admitted) / len(admitted)


@pytest.mark.parametrize("workload,capacity", [("multi-turn", 15.0), ("shared-prefix", 30.0), ("skewed", 15.0)])
def test_goodput_holds_at_two_and_five_times_capacity(workload, capacity):
    """slo_goodput rejects what it predicts will miss: at 2x and 5x the load it serves within
    SLO, the requests per second that meet their SLOs stay within 10% of that load's, and
    at least 85% of the admitted requests still meet them."""
    at_capacity = simulate("slo_goodput", workload, capacity)
    assert summarize(at_capacity, *SLO)["slo_attainment"] >= 0.9
    base = good_rps(at_capacity, capacity)
    for factor in (2, 5):
        records = simulate("slo_goodput", workload, capacity * factor)
        assert good_rps(records, capacity * factor) >= 0.9 * base, factor
        rejected = [r for r in records if r["worker"] is None]
        assert rejected and all(r["error"].startswith("rejected: no worker meets the SLOs") for r in rejected)
        admitted = [r for r in records if r["worker"] is not None]
        assert summarize(admitted, *SLO)["slo_attainment"] >= 0.85, factor


def test_shared_prefix_goodput_at_least_prefix_affinitys():
    """At a load prefix_affinity sustains, slo_goodput does too and rejects nothing: it
    rejected a fifth of the requests at 30 req/s (attainment 0.80 against 0.94), each
    predicted to overflow a KV pool that its own placement had filled with second copies of
    prefixes, when admitting them met their SLOs."""
    affinity = summarize(simulate("prefix_affinity", "shared-prefix", 30.0), *SLO)["slo_attainment"]
    records = simulate("slo_goodput", "shared-prefix", 30.0)
    assert affinity >= 0.9
    assert summarize(records, *SLO)["slo_attainment"] >= affinity
    assert all(r["worker"] is not None for r in records)


def test_a_hot_prefix_beyond_its_holder_is_copied_the_faster_way():
    """When a hot prefix outgrows its holder, slo_goodput ships it from the holder by KV import
    only where that is predicted to answer sooner than recomputing it: on the H200 profile a
    2048-token prefix recomputes in ~21 ms, while a warm pair's prefill waits its turn in the
    holder's full pool. Priced without that wait, 8 warm pairs here took ~1 s each and hot
    requests were refused meanwhile (attainment 0.876 against 0.912 without warming). Skewed
    traffic with 80% of requests on one prefix, at 36 req/s."""

    def run(warm: bool):
        fleet = FleetConfig(
            workers=WORKERS,
            sim=SimConfig(num_blocks=1024),
            cost=COST,
            views_with_cost=True,
            slo_ttft_ms=SLO[0],
            slo_tpot_ms=SLO[1],
        )
        wl = WorkloadConfig(name="skewed", rate=36.0, duration_s=15.0, seed=0, hot="0.8")
        sim = FleetSim(load_policy("slo_goodput", warm_prefixes=warm), fleet)
        return sim, sim.run(generate(wl), wl.duration_s)

    cold_sim, cold = run(False)
    warm_sim, warm = run(True)
    assert cold_sim.pd_routed == warm_sim.pd_routed == 0
    assert summarize(warm, *SLO)["slo_attainment"] >= summarize(cold, *SLO)["slo_attainment"] >= 0.9
