"""Shared by the report and simulator tests: the metrics every entry of a report carries, and a
small simulator run of slo_goodput beside round_robin."""

import json
from pathlib import Path

ENTRY_METRICS = (
    "goodput_rps",
    "slo_attainment",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "cached_token_ratio",
    "throughput_tok_s",
)


def two_policy_sim(out: Path, duration_s: int, *extra: str) -> dict:
    """`python -m bench.simulate` on 2 workers, slo_goodput and round_robin, a random workload at
    5 req/s for `duration_s`, with `extra` flags; the report it wrote to `out`."""
    from bench import simulate

    simulate.main(
        [
            "--workers",
            "2",
            "--policies",
            "slo_goodput,round_robin",
            "--workload",
            "random",
            "--input-len",
            "64",
            "--output-len",
            "8",
            "--rate",
            "5",
            "--duration",
            str(duration_s),
            "--jobs",
            "1",
            *extra,
            "--out",
            str(out),
        ]
    )
    return json.loads(out.read_text())
