"""Calibration: it recovers a known cost model, and a simulation with the profile it measures
reproduces a real CPU SmolLM2 fleet's TTFT and TPOT medians within 15%."""
import asyncio
import json
import os

import numpy as np
import pytest

from bench import calibrate
from bench.fleet_sim import FleetConfig, FleetSim
from bench.loadgen import run_rate
from bench.report import summarize
from bench.sim_worker import SimConfig
from bench.workloads import WorkloadConfig, generate
from policies.registry import load_policy
from tests.procs import start_worker
from workers.kv.cost_model import CostModel

KNOWN = {"base_ms": 10.0, "prefill_token_ms": 0.3, "prefill_attn_ms": 0.5, "decode_seq_ms": 1.5,
         "decode_kv_token_ms": 0.002}


def test_nnls_keeps_coefficients_non_negative():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert calibrate.nnls(a, np.array([3.0, 2.0, 1.0])).tolist() == [2.0, 0.0]
    assert calibrate.nnls(a, np.array([2.0, 3.0, 4.0])) == pytest.approx([1.0, 1.0])


def test_recovers_a_known_cost_model(tmp_path):
    """A sim-executor worker sleeps exactly by KNOWN; calibration must find KNOWN again."""
    path = tmp_path / "known.json"
    path.write_text(json.dumps(KNOWN))
    w = start_worker("known", executor="sim", extra=["--sim-profile", str(path)]).ready()
    try:
        profile = calibrate.calibrate([w.url], [16, 64, 128, 256, 512], [1, 2, 4, 8])
    finally:
        w.stop()
    for k in ("base_ms", "prefill_token_ms", "decode_seq_ms"):
        assert profile[k] == pytest.approx(KNOWN[k], rel=0.1), k
    assert profile["fit_rel_rmse"] < 0.05
    assert 0 < profile["request_overhead_ms"] < 50


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KVGATE_FIDELITY_TESTS") != "1",
                    reason="timing-sensitive: the 15% bound holds on a quiet machine but not reliably on a shared "
                           "2-core one; run with KVGATE_FIDELITY_TESTS=1")
def test_simulation_matches_real_smollm2_fleet(monkeypatch, tmp_path):
    """Two torch SmolLM2 workers (one CPU thread each) behind client-side round robin; the
    simulator, given the profile calibrated on both of them at once (they share this
    machine's cores, and the workload keeps both busy), runs the same seeded workload with
    the round_robin policy (the same assignment) and must land within 15% of the real
    median TTFT and TPOT."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    workers = [start_worker(f"cpu{i}", executor="torch", log_dir=str(tmp_path)) for i in range(2)]
    try:
        for w in workers:
            w.ready(300)
        profile = calibrate.calibrate([w.url for w in workers], [16, 32, 64, 128, 256], [1, 2, 4], decode_tokens=20)
        wl = WorkloadConfig(name="shared-prefix", rate=2.0, duration_s=40, seed=7, groups=2,
                            prefix_len=128, question_len=32, output_len=12)
        real = asyncio.run(run_rate([w.url for w in workers], wl, "smollm2-135m", (5000, 1000)))
    finally:
        for w in workers:
            w.stop()
    fleet = FleetConfig(workers=2, sim=SimConfig(num_blocks=1024, max_model_len=8192),
                        cost=CostModel.from_json(profile), request_overhead_ms=profile["request_overhead_ms"])
    sim = FleetSim(load_policy("round_robin"), fleet).run(generate(wl), wl.duration_s)
    r, s = summarize(real, 5000, 1000), summarize(sim, 5000, 1000)
    assert r["errors"] == 0 and s["errors"] == 0
    assert r["cached_token_ratio"] == pytest.approx(s["cached_token_ratio"], abs=0.02)
    report = {k: (r[k], s[k]) for k in ("ttft_p50_ms", "tpot_p50_ms")}
    for k, (real_ms, sim_ms) in report.items():
        assert sim_ms == pytest.approx(real_ms, rel=0.15), f"{k}: real {real_ms:.1f} ms, simulated {sim_ms:.1f} ms ({report})"
