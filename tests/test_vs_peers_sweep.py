"""bench.vs_peers' rate sweep: ascending rates until one fails, +50% steps past the list (-1/3
steps below it while none passed), then bisections between the last passing and first failing
rate (run against a stand-in for the fleet whose attainment is a step at a known knee); and
bench.router_overhead's requests taking turns between the direct path and the routers."""

import argparse
import types

from bench import router_overhead
from bench.vs_peers import Bench, knee
from bench.workloads import WorkloadConfig


def _bench(rates: str, max_extra: int, refine: int, capacity: float) -> tuple[Bench, list[float]]:
    bench = Bench.__new__(Bench)
    bench.args = argparse.Namespace(rates=rates, max_extra=max_extra, refine=refine)
    asked: list[float] = []

    def measure(self, urls, wl, pid):
        asked.append(wl.rate)
        return {
            "rate_rps": wl.rate,
            "slo_attainment": 1.0 if wl.rate <= capacity else 0.5,
            "ttft_p50_ms": 1.0,
            "errors": 0,
        }

    bench.measure = types.MethodType(measure, bench)
    return bench, asked


def _sweep(bench: Bench) -> list[dict]:
    router = types.SimpleNamespace(url="http://x", popen=types.SimpleNamespace(pid=1))
    return bench.sweep("kvgate-x", router, WorkloadConfig(name="random", duration_s=1.0))


def test_bisects_between_the_last_pass_and_the_first_fail():
    bench, asked = _bench("8,14,20", max_extra=2, refine=2, capacity=16.0)
    runs = _sweep(bench)
    assert asked == [8.0, 14.0, 20.0, 17.0, 15.5]
    assert [r["rate_rps"] for r in runs] == sorted(asked)
    assert knee(runs) == (15.5, 17.0)


def test_extra_rates_then_bisection_when_every_listed_rate_passes():
    bench, asked = _bench("8,14", max_extra=2, refine=1, capacity=25.0)
    _sweep(bench)
    assert asked == [8.0, 14.0, 21.0, 31.5, 26.2]


def test_no_bisection_without_a_failing_rate_or_with_refine_zero():
    bench, asked = _bench("8,14", max_extra=0, refine=3, capacity=100.0)
    _sweep(bench)
    assert asked == [8.0, 14.0]
    bench, asked = _bench("8,14,20", max_extra=0, refine=0, capacity=10.0)
    _sweep(bench)
    assert asked == [8.0, 14.0]


def test_knee_needs_a_pass_below_a_fail_more_than_min_gap_apart():
    assert knee([{"rate_rps": 8.0, "slo_attainment": 0.5}]) is None
    assert knee([{"rate_rps": 8.0, "slo_attainment": 0.95}, {"rate_rps": 8.5, "slo_attainment": 0.2}]) is None
    assert knee([{"rate_rps": 8.0, "slo_attainment": 0.95}, {"rate_rps": 12.0, "slo_attainment": 0.2}]) == (8.0, 12.0)


def test_steps_down_when_the_first_rate_fails_then_bisects():
    bench, asked = _bench("28,36", max_extra=2, refine=1, capacity=15.0)
    runs = _sweep(bench)
    assert asked == [28.0, 18.7, 12.5, 15.6]
    assert knee(runs) == (12.5, 15.6)


def test_overhead_takes_turns_and_credits_each_request_to_its_target(monkeypatch):
    """Request i goes to the i-th url of the turn order (as `loadgen.run_rate` sends it) and its
    TTFT is credited to that url's target: with a stand-in fleet whose TTFT is fixed per url, the
    direct path's figures are the workers' own and each router's added TTFT is exactly its own.
    Each run empties the caches first and sends prompts no earlier run sent."""
    ttft_of = {"http://w0": 10.0, "http://w1": 12.0, "http://a": 13.0, "http://b": 20.0}
    sent: list[str] = []
    seeds: list[int] = []
    resets: list[int] = []

    async def run_rate(order, wl, model, slo, timeout, text):
        seeds.append(wl.seed)
        out = []
        for i in range(40):
            sent.append(order[i % len(order)])
            out.append({"ttft_ms": ttft_of[sent[-1]], "error": None})
        return out

    monkeypatch.setattr(router_overhead, "run_rate", run_rate)
    bench = Bench.__new__(Bench)
    bench.args = argparse.Namespace(
        low_rate=2.0, low_duration=1.0, model="smollm2-135m", timeout=5.0, overhead_repeat=2
    )
    bench.slo, bench.text = (2000.0, 100.0), str
    bench.start_router = lambda label, urls: types.SimpleNamespace(url="http://" + label)
    cpu_runs: list[str] = []
    cpu_of = {"a": [5.0, 9.0], "b": [7.0, 3.0]}

    def cpu_ms(bench, label, urls):
        cpu_runs.append(label)
        return cpu_of[label][cpu_runs.count(label) - 1]

    monkeypatch.setattr(router_overhead, "cpu_ms", cpu_ms)
    bench.reset = lambda: resets.append(len(seeds))
    monkeypatch.setattr(router_overhead, "stop_all", lambda procs: None)
    monkeypatch.setattr(router_overhead, "SETTLE_S", 0.0)
    out = router_overhead.overhead(bench, ["a", "b"], ["http://w0", "http://w1"])
    assert sent[:6] == ["http://w0", "http://a", "http://b", "http://w1", "http://a", "http://b"]
    assert out["direct"]["ttft_p50_ms"] == 11.0
    assert out["a"]["added_ttft_p50_ms"] == 2.0 and out["b"]["added_ttft_p50_ms"] == 9.0
    assert out["a"]["requests"] == 2 * 13 and len(out["a"]["runs"]) == 2
    assert resets == [0, 1] and len(set(seeds)) == 2, "each run starts cold, with prompts of its own"
    assert cpu_runs == ["a", "b", "a", "b"], "the routers' CPU runs take turns"
    assert out["a"]["cpu_ms_runs"] == [5.0, 9.0] and out["a"]["cpu_ms_per_request"] == 7.0
    assert out["b"]["cpu_ms_per_request"] == 5.0
