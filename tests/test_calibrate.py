"""Calibration: the fit recovers a known cost model exactly (batch-size table and mixed-step
cost too), measured workers twice as slow read about twice as slow, a profile rescaled to a
worker's logged steps finds how much slower each kind of work ran, and a simulation with the
profile it measures reproduces a real fleet's medians. Wall-clock checks compare measurements of
one run with wide ratios, so a busy machine does not fail them; how close they come on an idle
one is `python -m bench.fidelity`'s JSON."""

import asyncio
import dataclasses
import json

import httpx
import numpy as np
import pytest

from bench import calibrate, calibrate_cli, fidelity
from bench.loadgen import run_rate
from bench.workloads import WorkloadConfig
from gateway.procs import start_worker
from workers.kv.cost_model import CostModel, StepWork
from workers.step_stats import StepRecord

KNOWN = {
    "base_ms": 10.0,
    "prefill_token_ms": 0.3,
    "prefill_attn_ms": 0.5,
    "decode_seq_ms": 1.5,
    "decode_kv_token_ms": 0.002,
}


def test_nnls_keeps_coefficients_non_negative():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert calibrate.nnls(a, np.array([3.0, 2.0, 1.0])).tolist() == [2.0, 0.0]
    assert calibrate.nnls(a, np.array([2.0, 3.0, 4.0])) == pytest.approx([1.0, 1.0])


def test_cost_model_decode_table_and_mixed_term():
    cost = CostModel(
        base_ms=10,
        prefill_token_ms=1,
        prefill_attn_ms=0,
        decode_seq_ms=2,
        decode_kv_token_ms=0.01,
        mixed_ms=5,
        decode_batch_ms=(20.0, 40.0, 30.0),
        decode_batch_slope_ms=3.0,
    )
    assert cost.step_ms(decode_seqs=2, decode_kv_tokens=100) == pytest.approx(41.0)
    assert cost.step_ms(decode_seqs=3) == 30.0 and cost.step_ms(decode_seqs=5) == 36.0  # table, then its slope
    assert cost.step_ms(prefill_tokens=8) == 18.0
    assert cost.step_ms(prefill_tokens=8, decode_seqs=2, decode_kv_tokens=100) == pytest.approx(18 + 4 + 1 + 5)
    assert CostModel.from_json(json.loads(json.dumps(cost.to_json()))) == cost
    assert CostModel.from_json(KNOWN).step_ms(decode_seqs=2) == pytest.approx(13.0)  # profiles without the new fields
    slow = cost.scaled(1.5)
    for work in ((0, 0.0, 2, 100), (0, 0.0, 5, 0), (8, 40.0, 2, 100), (8, 40.0, 0, 0)):
        assert slow.step_ms(*work) == pytest.approx(1.5 * cost.step_ms(*work))


def synthetic_samples(true: CostModel, overhead: float) -> list[dict]:
    """Probe results as `Probe` reports them, for a worker whose steps take exactly `true` + overhead."""
    samples = []
    for n, c in ((16, 0), (64, 0), (256, 0), (512, 0), (32, 128), (64, 256)):
        ms = true.step_ms(n, n * (c + n / 2))
        samples.append(
            {
                "kind": "prefill",
                "key": ("prefill", n, c),
                "ms": ms,
                "tokens": n,
                "ctx": n * (c + n / 2),
                "ttft_ms": ms + overhead + 3.0,
            }
        )
    for ctx in (16, 256):
        for b in range(1, len(true.decode_batch_ms) + 1):
            kv = b * (ctx + 20)
            ms = true.step_ms(decode_seqs=b, decode_kv_tokens=kv)
            samples.append(
                {
                    "kind": "decode",
                    "key": ("decode", b, ctx),
                    "batch": b,
                    "kv": float(kv),
                    "ms": ms,
                    "gap_ms": ms + overhead,
                }
            )
            n = max(16, ctx // 4)
            ms = true.step_ms(n, n * (ctx + n / 2), b, kv)
            samples.append(
                {
                    "kind": "mixed",
                    "key": ("mixed", b, ctx),
                    "batch": b,
                    "tokens": n,
                    "ctx": n * (ctx + n / 2),
                    "kv": kv,
                    "ms": ms,
                }
            )
    return samples


def test_fit_recovers_a_nonlinear_decode_table_and_the_mixed_cost():
    """Small decode batches that are not linear in their size (3 dearer than 4, as on a CPU;
    from 4 on, 3 ms a sequence), decodes beside a prefill that cost less per sequence than that
    plus a fixed cost for running beside it: the fit must find all of them."""
    true = CostModel(
        base_ms=50,
        prefill_token_ms=2.5,
        prefill_attn_ms=1.0,
        decode_seq_ms=1.0,
        decode_kv_token_ms=0.02,
        mixed_ms=30,
        decode_batch_ms=(58, 90, 113, 84, 87, 90, 93),
        decode_batch_slope_ms=3.0,
    )
    profile = calibrate.fit(synthetic_samples(true, overhead=0.5))
    expected = {**{k: getattr(true, k) for k in calibrate.COLUMNS}, "base_ms": true.base_ms + 0.5}  # + step overhead
    assert {k: profile[k] for k in calibrate.COLUMNS} == pytest.approx(expected, rel=0.02, abs=1e-4)
    assert profile["decode_batch_ms"] == pytest.approx([v + 0.5 for v in true.decode_batch_ms], rel=0.01)
    assert profile["decode_batch_slope_ms"] == pytest.approx(3.0)
    assert profile["step_overhead_ms"] == pytest.approx(0.5)
    assert profile["request_overhead_ms"] == pytest.approx(3.0)
    assert profile["fit_rel_rmse"] < 0.01


def test_calibration_tells_a_worker_twice_as_slow(tmp_path):
    """Two sim-executor workers sleep by KNOWN and by twice KNOWN; calibrated in the same run,
    the second profile prices a prefill and a decode batch about twice the first. (That it
    finds KNOWN itself is a timing claim: `kvgate calibrate --model smollm2-135m --executor sim
    --worker-arg=--sim-profile=...` on an idle machine; the fit alone is checked exactly above.)"""
    slow = CostModel.from_json(KNOWN).scaled(2.0)
    (tmp_path / "known.json").write_text(json.dumps(KNOWN))
    (tmp_path / "slow.json").write_text(json.dumps(slow.to_json()))
    profiles = []
    for name in ("known", "slow"):
        w = start_worker(name, executor="sim", extra=["--sim-profile", str(tmp_path / f"{name}.json")]).ready()
        try:
            profiles.append(calibrate.calibrate([w.url], [16, 128, 512], [1, 2, 4], decode_tokens=12, rounds=1))
        finally:
            w.stop()
    for p in profiles:
        assert all(p[k] >= 0 for k in calibrate.COLUMNS) and len(p["decode_batch_ms"]) == 4
        assert p["fit"] and p["fit_rel_rmse"] >= 0
    fast, slow_fit = (CostModel.from_json(p) for p in profiles)
    for work in ((512, 512 * 256.0, 0, 0), (0, 0.0, 4, 4 * 60)):
        assert 1.3 < slow_fit.step_ms(*work) / fast.step_ms(*work) < 3.0, work


def logged_steps(true: CostModel, overhead: float, n: int = 300) -> list[StepRecord]:
    """A worker's step log (GET /steps) for steps that took `true` in all, `overhead` of it
    outside the executor: decode-only, prefill-only and mixed steps of varied sizes."""
    rng, steps = np.random.default_rng(3), []
    for _ in range(n):
        p = int(rng.choice([0, 0, 16, 96, 300]))
        seqs = int(rng.integers(0 if p else 1, 7))
        kv, ctx = seqs * int(rng.integers(100, 900)), p * (int(rng.integers(0, 500)) + p / 2)
        work = StepWork(p, ctx, seqs, kv)
        wall = true.work_ms(work)
        steps.append(StepRecord(wall - overhead, work, wall))
    return steps


def test_two_factor_scaling_prices_decoding_rows_apart():
    cost = CostModel(**KNOWN, mixed_ms=2.0, decode_batch_ms=(9.0, 11.0), decode_batch_slope_ms=1.0)
    both = cost.scaled(1.5, 0.5)
    assert both.step_ms(decode_seqs=4, decode_kv_tokens=800) == pytest.approx(0.5 * cost.step_ms(0, 0, 4, 800))
    assert both.step_ms(64, 9000.0) == pytest.approx(1.5 * cost.step_ms(64, 9000.0))
    rows = KNOWN["decode_seq_ms"] * 3 + KNOWN["decode_kv_token_ms"] * 600
    assert both.step_ms(64, 9000.0, 3, 600) == pytest.approx(
        1.5 * (cost.step_ms(64, 9000.0, 3, 600) - rows) + 0.5 * rows
    )


def test_speed_factors_recover_how_much_slower_each_kind_ran():
    cost = CostModel(**KNOWN, mixed_ms=2.0, decode_batch_ms=(9.0, 11.0, 12.0), decode_batch_slope_ms=1.0)
    for prefill, decode in ((1.0, 1.0), (1.3, 0.8), (0.7, 1.6)):
        steps = logged_steps(cost.scaled(prefill, decode), overhead=0.5)
        assert calibrate.speed_factors(cost, steps) == pytest.approx((prefill, decode))
    skewed = logged_steps(cost.scaled(1.3, 0.8), overhead=0.5)
    for i in range(0, len(skewed), 10):  # it lost its core for a while: the totals still match
        skewed[i] = dataclasses.replace(skewed[i], wall_ms=skewed[i].wall_ms * 3)
    now = cost.scaled(*calibrate.speed_factors(cost, skewed))
    for group in ([s for s in skewed if s.work.prefill_tokens == 0], [s for s in skewed if s.work.prefill_tokens > 0]):
        total = sum(now.work_ms(s.work) for s in group)
        assert total == pytest.approx(sum(s.wall_ms for s in group))
    only_decodes = [s for s in logged_steps(cost.scaled(1.0, 1.2), 0.0) if s.work.prefill_tokens == 0]
    assert calibrate.speed_factors(cost, only_decodes) == pytest.approx((1.0, 1.2))


def test_rescale_from_a_workers_step_log(tmp_path):
    """A sim-executor worker running 1.4x slower prefills and 0.7x decodes than KNOWN: `kvgate
    calibrate --rescale` reads its step log (GET /steps) and finds both factors."""
    known = {**KNOWN, "decode_batch_ms": [30.0 + 4 * b for b in range(8)], "decode_batch_slope_ms": 4.0}
    truth = CostModel.from_json(known).scaled(1.4, 0.7)
    (tmp_path / "truth.json").write_text(json.dumps(truth.to_json()))
    (tmp_path / "known.json").write_text(json.dumps({**known, "request_overhead_ms": 2.0}))
    w = start_worker("slow", executor="sim", extra=["--sim-profile", str(tmp_path / "truth.json")]).ready()
    try:
        assert httpx.get(w.url + "/steps", params={"after": "x"}).status_code == 400
        wl = WorkloadConfig(
            name="shared-prefix",
            rate=20.0,
            duration_s=2,
            seed=1,
            groups=2,
            prefix_len=64,
            question_len=32,
            output_len=12,
        )
        model = w.state()["model"]
        assert all(r["error"] is None for r in asyncio.run(run_rate([w.url], wl, model, (5000, 1000))))
        last, steps = calibrate.step_log(w.url)
        numbered = httpx.get(w.url + "/steps").json()["steps"]
        assert [s["step"] for s in numbered] == list(range(last - len(steps) + 1, last + 1))
        assert calibrate.step_log(w.url, last - 3)[1] == steps[-3:]
        calibrate_cli.main(
            ["--url", w.url, "--rescale", str(tmp_path / "known.json"), "--out", str(tmp_path / "now.json")]
        )
    finally:
        w.stop()
    now = json.loads((tmp_path / "now.json").read_text())
    factors = now["rescaled"]
    assert factors["steps"] == len(steps) > 20
    # two factors of one run: prefills ran twice as slow as decodes, against KNOWN (wide: on a busy
    # machine each step also waits for a core, which weighs more on the shorter decode steps)
    assert 1.3 < factors["prefill"] / factors["decode"] < 3.0
    assert factors["prefill"] > 1.0
    assert now["base_ms"] == pytest.approx(KNOWN["base_ms"] * factors["prefill"])
    assert now["request_overhead_ms"] == pytest.approx(2.0 * factors["overall"])


@pytest.mark.slow
def test_simulation_matches_real_smollm2_fleet(monkeypatch, tmp_path):
    """Two torch SmolLM2 workers (one CPU thread each) behind client-side round robin; the
    simulator, given the profile calibrated on both of them at once, runs the same seeded
    workload with the round_robin policy (the same assignment) and lands within a factor of two
    of the real median TTFT and TPOT (how close on an idle machine: `python -m bench.fidelity`,
    JSON in bench/results/).

    The workload keeps each worker decoding one to four requests most of the time, and a new
    request waits only for the step in progress before it prefills its 32-token question after
    the cached 128-token prefix beside those decodes: TTFT is compute, not overhead, and
    queueing does not amplify small speed errors. Calibration warms the workers up first.

    A shared machine's speed drifts between minutes, so the probes give the profile's shape and
    its speed is rescaled (prefill and decode apart) to the steps the workers logged during the
    run, as `kvgate calibrate --rescale` does: what the simulation takes from the run is step
    times; the latencies compared come out of its own queueing and batching."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    workers = [start_worker(f"cpu{i}", executor="torch", log_dir=str(tmp_path)) for i in range(2)]
    wl = WorkloadConfig(
        name="shared-prefix", rate=2.0, duration_s=20, seed=7, groups=2, prefix_len=128, question_len=32, output_len=20
    )
    try:
        for w in workers:
            w.ready(300)
        urls = [w.url for w in workers]
        profile = calibrate.calibrate(urls, [16, 32, 64, 128, 256], [1, 2, 3, 4, 5, 6], decode_tokens=12, rounds=1)
        records, steps = fidelity.run(urls, wl, "smollm2-135m")
        sim = fidelity.sim_config(urls[0])
    finally:
        for w in workers:
            w.stop()
    got = fidelity.compare(profile, wl, records, steps, len(workers), sim)
    real, simulated = got["real"], got["rescaled"]
    print(f"real, simulated: {real}, {simulated}; speed factors {got['speed_factors']}")
    assert got["errors"] == 0 and simulated["errors"] == 0
    assert simulated["cached_token_ratio"] == pytest.approx(real["cached_token_ratio"], abs=0.02)
    for k in fidelity.METRICS:
        assert 0.5 < simulated[k] / real[k] < 2.0, f"{k}: real {real[k]:.1f} ms, simulated {simulated[k]:.1f} ms"


def test_fidelity_benchmark_on_sim_workers(tmp_path):
    """`python -m bench.fidelity` against two sim-executor workers that sleep by KNOWN: every
    rate is reported, real against simulated, and the rescaled simulation lands within a factor
    of two (the workers' steps are the cost model's, so only scheduling and HTTP can differ; how
    close on an idle machine is the benchmark's JSON)."""
    path = tmp_path / "known.json"
    path.write_text(json.dumps(KNOWN))
    workers = [start_worker(f"known{i}", executor="sim", extra=["--sim-profile", str(path)]) for i in range(2)]
    out = tmp_path / "fidelity.json"
    try:
        for w in workers:
            w.ready()
        fidelity.main(
            [a for w in workers for a in ("--url", w.url)]
            + [
                "--rates",
                "4,8",
                "--duration",
                "4",
                "--groups",
                "2",
                "--prefix-len",
                "64",
                "--question-len",
                "32",
                "--output-len",
                "8",
                "--lengths",
                "16,64,128",
                "--batches",
                "1,2,3",
                "--rounds",
                "1",
                "--warmup-s",
                "1",
                "--out",
                str(out),
            ]
        )
    finally:
        for w in workers:
            w.stop()
    report = json.loads(out.read_text())
    assert [r["rate_rps"] for r in report["runs"]] == [4.0, 8.0]
    assert report["warmup"]["requests"] >= 4 and report["warmup"]["errors"] == 0
    assert (tmp_path / "fidelity.png").exists()
    for r in report["runs"]:
        assert r["errors"] == 0 and r["rescaled"]["errors"] == 0
        assert r["speed_factors"]["steps"] > 0
        for k in fidelity.METRICS:
            assert 0.5 < r["rescaled"]["ratio"][k] < 2.0, (k, r)
