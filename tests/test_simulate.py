"""The fleet simulator: exact event skipping, seeded, ranks policies the way caching says it
should, degrades with load, and serves 128 workers at a high rate."""

import json

import pytest

from bench import simulate
from bench.chain_hasher import ChainHasher
from bench.fleet_sim import FleetConfig, FleetSim
from bench.report import summarize
from bench.sim_worker import SimConfig
from bench.workloads import WorkloadConfig, generate
from policies.registry import BUILTIN_POLICIES, load_policy
from workers.kv.cost_model import CostModel
from workers.kv.hashing import block_hashes
from tests.sim_report import ENTRY_METRICS, two_policy_sim


def run(policy="prefix_affinity", workers=4, wl=None, **sim):
    wl = wl or WorkloadConfig(name="shared-prefix", rate=15, duration_s=15, seed=1)
    fleet = FleetConfig(workers=workers, sim=SimConfig(**sim), slo_ttft_ms=1000, slo_tpot_ms=30)
    s = FleetSim(load_policy(policy), fleet)
    records = s.run(generate(wl), wl.duration_s)
    return s, sorted(records, key=lambda r: r["arrival_s"])


@pytest.mark.parametrize(
    "name,blocks", [("shared-prefix", 4096), ("shared-prefix", 300), ("multi-turn", 300), ("random", 4096)]
)
def test_fast_forward_is_exact(name, blocks):
    """Decode segments give the very records that stepping every decode gives, under KV
    pressure (preemption, eviction) too."""
    wl = WorkloadConfig(name=name, rate=15, duration_s=12, seed=2)
    fast, a = run(wl=wl, num_blocks=blocks)
    slow, b = run(wl=wl, num_blocks=blocks, fast_forward=False)
    assert a == b
    assert fast.events_processed < slow.events_processed
    assert len(a) > 100 and all(r["error"] is None for r in a)


@pytest.mark.parametrize("name", ["random", "mixed"])
def test_fast_forward_is_exact_with_a_measured_profile(name):
    """slo_goodput rescales its cost model by the step times the polls read: those must be the
    steps that have ended, in both modes, as in the engine's /state (a poll mid-step reads the
    steps before it, whether the step is one of a decode segment or not)."""
    cost = CostModel.load("bench/profiles/h200-llama8b-kvgate-eager.json")
    wl = WorkloadConfig(name=name, rate=40, duration_s=10, seed=3)

    def records(ff):
        fleet = FleetConfig(
            workers=4, sim=SimConfig(fast_forward=ff, num_blocks=16384), cost=cost, slo_ttft_ms=1000, slo_tpot_ms=40
        )
        return sorted(
            FleetSim(load_policy("slo_goodput"), fleet).run(generate(wl), wl.duration_s),
            key=lambda r: (r["arrival_s"], r["prompt_tokens"]),
        )

    a = records(True)
    assert a == records(False)
    assert len({r["worker"] for r in a} - {None}) == 4 and len(a) > 300


def test_a_poll_mid_step_reads_the_state_before_the_step():
    """/state is the engine's snapshot after its last step: a request admitted by the step in
    progress still shows as waiting, with its blocks still free."""
    from bench.sim_worker import SimWorker
    from workers.request import Request
    from workers.sampling_params import SamplingParams

    w = SimWorker("w0", SimConfig(num_blocks=64, block_size=16), CostModel(), lambda req, now: None)
    before = w.state()
    end = w.advance(w.submit(Request("a", list(range(100, 180)), SamplingParams(max_tokens=4)), 0.0))
    assert end > 0.0 and w.plan is not None
    mid = w.state()
    assert (
        (mid.running, mid.free_blocks, mid.step_ms)
        == (0, 64, None)
        == (before.running, before.free_blocks, before.step_ms)
    )
    w.advance(end)
    after = w.state()
    assert after.running == 1 and after.free_blocks < 64 and after.step_ms > 0


def test_chain_hasher_gives_block_hashes():
    """Memoised by runs and by blocks, evicted when full: the values never change."""
    hasher = ChainHasher(4, 7, span=3, limit=40)
    doc = list(range(100, 160))
    prompts = [doc, doc[:30] + [1] * 9, doc + [2] * 5, doc[:7], [], doc[:30] + [1] * 9, doc]
    for tokens in prompts * 3:
        assert hasher.hashes(tokens) == block_hashes(tokens, 4, 7)
    assert hasher.runs, "content seen twice is looked up by runs"


def test_seeded_runs_repeat():
    assert run()[1] == run()[1]


def test_index_mirrors_each_pool():
    """The router's residency index, fed only by KV events, equals every worker's prefix cache."""
    s, records = run(num_blocks=400)
    for w in s.workers:
        held = {h for h in w.pool.resident_hashes()}
        assert s.index.num_blocks(w.worker_id) == len(held)
        assert all(s.index.holds(w.worker_id, h) for h in held)


def test_prefix_affinity_beats_round_robin_on_cached_tokens():
    """32 prefixes, room for about 8 per worker: round robin makes every worker cycle through
    all of them and thrash; affinity keeps each prefix where it is cached."""
    wl = WorkloadConfig(
        name="shared-prefix", rate=20, duration_s=20, seed=0, groups=32, prefix_len=1024, question_len=32, output_len=16
    )
    ratios = {}
    for policy in ("round_robin", "prefix_affinity"):
        _, records = run(policy, workers=8, wl=wl, num_blocks=560)
        ratios[policy] = summarize(records, 1000, 30)["cached_token_ratio"]
    assert ratios["prefix_affinity"] > ratios["round_robin"] + 0.2


def test_attainment_falls_as_rate_rises():
    wl = WorkloadConfig(name="shared-prefix", duration_s=10, seed=0, groups=4, prefix_len=512)
    att = []
    for rate in (5, 60, 200):
        _, records = run("least_load", workers=2, wl=wl.with_rate(rate))
        att.append(summarize(records, 1000, 30)["slo_attainment"])
    assert att[0] > 0.95 and att[0] >= att[1] >= att[2] and att[2] < 0.5


def test_every_builtin_policy_runs():
    for policy in BUILTIN_POLICIES:
        _, records = run(policy, wl=WorkloadConfig(name="multi-turn", rate=10, duration_s=5))
        assert records and summarize(records, 1000, 30)["completed"] > 0


def test_request_overhead_delays_first_token():
    wl = WorkloadConfig(name="random", rate=2, duration_s=10, seed=0, input_len=64)
    base = summarize(run(wl=wl)[1], 1000, 30)
    fleet = FleetConfig(workers=4, slo_ttft_ms=1000, slo_tpot_ms=30, request_overhead_ms=25.0)
    late = summarize(FleetSim(load_policy("prefix_affinity"), fleet).run(generate(wl), 10), 1000, 30)
    assert late["ttft_p50_ms"] == pytest.approx(base["ttft_p50_ms"] + 25.0, abs=1.0)
    assert late["tpot_p50_ms"] == pytest.approx(base["tpot_p50_ms"])


@pytest.mark.slow
def test_128_workers_at_high_rate():
    """128 H200-like workers at 1500 req/s: 4500 requests of 2k-token prompts, all served, on
    every worker (how fast: `kvgate simulate --workers 128`, `wall_s` in its JSON)."""
    cost = CostModel.load("bench/profiles/h200-llama8b.json")
    fleet = FleetConfig(workers=128, sim=SimConfig(num_blocks=2048), cost=cost, slo_ttft_ms=1000, slo_tpot_ms=50)
    wl = WorkloadConfig(name="shared-prefix", rate=1500, duration_s=3, seed=0)
    s = FleetSim(load_policy("prefix_affinity"), fleet)
    out = summarize(s.run(generate(wl), wl.duration_s), 1000, 50)
    assert out["requests"] > 4000 and out["completed"] == out["requests"]
    assert out["workers_used"] == 128


def test_cli_sweep_writes_report_and_plots(tmp_path):
    out = tmp_path / "sim.json"
    simulate.main(
        [
            "--workers",
            "2",
            "--policies",
            "round_robin,kv_cost",
            "--workload",
            "shared-prefix",
            "--groups",
            "4",
            "--prefix-len",
            "256",
            "--sweep",
            "5,80",
            "--duration",
            "5",
            "--slo-ttft-ms",
            "500",
            "--slo-tpot-ms",
            "30",
            "--jobs",
            "1",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert report["reference_rate_rps"] == 5
    for name in ("round_robin", "kv_cost"):
        e = report["policies"][name]
        for key in ENTRY_METRICS:
            assert isinstance(e[key], float), key
        assert [r["rate_rps"] for r in e["runs"]] == [5, 80]
    assert all((tmp_path / p.split("/")[-1]).exists() for p in report["plots"])


def test_goodput_search_brackets_the_90_percent_crossing(tmp_path):
    out = tmp_path / "search.json"
    simulate.main(
        [
            "--workers",
            "2",
            "--policies",
            "least_load",
            "--workload",
            "random",
            "--input-len",
            "256",
            "--output-len",
            "32",
            "--sweep",
            "--refine",
            "2",
            "--duration",
            "8",
            "--slo-ttft-ms",
            "300",
            "--slo-tpot-ms",
            "30",
            "--jobs",
            "1",
            "--out",
            str(out),
        ]
    )
    e = json.loads(out.read_text())["policies"]["least_load"]
    assert e["goodput_method"] == "interpolated"
    passing = [r["rate_rps"] for r in e["runs"] if r["slo_attainment"] >= 0.9]
    failing = [r["rate_rps"] for r in e["runs"] if r["slo_attainment"] < 0.9]
    assert max(passing) <= e["goodput_rps"] <= min(f for f in failing if f > max(passing))


def test_policy_args_reach_the_policies_that_take_them(tmp_path, monkeypatch):
    built = []
    real = simulate.load_policy
    monkeypatch.setattr(simulate, "load_policy", lambda spec, **kw: built.append((spec, kw)) or real(spec, **kw))
    out = tmp_path / "args.json"
    report = two_policy_sim(out, 3, "--policy-arg", "pd_min_uncached_tokens=256", "--policy-arg", "tpot_ms=80.5")
    args = report["policy_args"]
    assert args == {"slo_goodput": {"pd_min_uncached_tokens": 256, "tpot_ms": 80.5}, "round_robin": {}}
    assert ("slo_goodput", args["slo_goodput"]) in built and ("round_robin", {}) in built
    with pytest.raises(SystemExit, match="no policy of round_robin takes --policy-arg typo"):
        simulate.main(["--policies", "round_robin", "--rate", "1", "--policy-arg", "typo=1", "--out", str(out)])


def test_state_reports_step_work_like_the_engine():
    """/state's step_* means are the work of the steps step_ms timed (as `Engine` reports them),
    so a policy without the cost model rescales its default model to the worker's speed."""
    cost = CostModel.load("bench/profiles/h200-llama8b.json")
    fleet = FleetConfig(workers=2, cost=cost, slo_ttft_ms=1000, slo_tpot_ms=50)
    wl = WorkloadConfig(name="mixed", rate=20, duration_s=3, seed=0)
    s = FleetSim(load_policy("slo_goodput"), fleet)
    s.run(generate(wl), wl.duration_s)
    for w in s.workers:
        st = w.state()
        work = (st.step_prefill_tokens, st.step_prefill_ctx_products, st.step_decode_seqs, st.step_decode_kv_tokens)
        assert st.step_ms == pytest.approx(cost.step_ms(*work))
