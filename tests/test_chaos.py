"""The chaos scenarios of `python -m bench.chaos`, at a size that stays in the suite: a soak
with workers SIGKILLed and restarted, and overload at 5x capacity. Real gateway and sim
workers on loopback; every request is judged by `bench.chaos_client`."""

import pytest

from bench import chaos


def args(tmp_path, *argv: str):
    return chaos.parser().parse_args([*argv, "--log-dir", str(tmp_path), "--out", str(tmp_path / "chaos.json")])


@pytest.mark.slow
def test_soak_with_workers_killed_loses_nothing_and_leaks_nothing(tmp_path):
    """2,000 requests, half streamed, while a random one of 3 workers is SIGKILLed every 1-3 s
    and restarted: every request is answered whole, or (a stream cut after its first token)
    ends with a clean error event; none is reset, lost, or failed before its answer started;
    no worker holds a block after; the gateway's memory stays flat."""
    run = chaos.run_soak(args(tmp_path, "--requests", "2000", "--workers", "3", "--kill-every", "1", "3"))
    assert sum(kind == "kill" for _, kind, _ in run["events"]) >= 2, run["events"]
    assert run["lost"] == 0 and run["dirty"] == 0, run["dirty_examples"]
    assert run["ok"] + run["clean_error"] == 2000, run["error_codes"]
    assert run["uncommitted_errors"] == 0, run["error_codes"]  # all retried, but streams already under way
    assert run["leaked_blocks"] == 0 and run["requests_left_on_workers"] == 0
    assert run["requests_left_at_gateway"] == 0
    assert run["rss_growth_mb"] < 20, run["rss_mb"]


def overload(tmp_path, *extra: str) -> dict:
    """One sim worker running 2 at a time, Poisson arrivals at 5x its measured capacity."""
    return chaos.run_overload(
        args(
            tmp_path,
            "--workers",
            "1",
            "--overload-seqs",
            "2",
            "--overload-s",
            "6",
            "--calibrate-rounds",
            "4",
            "--overload-variants",
            "admission",
            "--policy",
            "round_robin",
            *extra,
        )
    )["admission"]


@pytest.mark.slow
def test_overload_is_answered_with_503_never_a_reset(tmp_path):
    """Beyond the per-worker queue bound (4) requests are refused at once with 503 and
    Retry-After; the worker never queues more than the bound; nothing is reset or lost."""
    run = overload(tmp_path, "--gateway-arg=--max-queue-per-worker=4")
    assert run["dirty"] == 0 and run["lost"] == 0 and run["clean_error"] == 0, run["dirty_examples"]
    assert run["ok"] > 0 and run["refused"] > run["ok"], run["error_codes"]
    assert set(run["error_codes"]) == {"503 overloaded"}
    assert run["max_worker_waiting"] <= 4


@pytest.mark.slow
def test_overload_slo_goodput_rejects_predicted_misses(tmp_path):
    """With queues unbounded only the policy stands between the worker and a growing queue:
    slo_goodput answers 429 for requests it predicts to miss their SLOs (it admitted every one
    before, while their TTFT grew to 12x the SLO)."""
    run = overload(
        tmp_path,
        "--policy",
        "slo_goodput",
        "--gateway-arg=--slo-ttft-ms=1000",
        "--gateway-arg=--max-queue-per-worker=1000000",
    )
    assert run["dirty"] == 0 and run["lost"] == 0 and run["clean_error"] == 0, run["dirty_examples"]
    assert run["error_codes"].get("429 policy_rejected", 0) > 0 and run["ok"] > 0
    assert run["max_worker_waiting"] < 20
