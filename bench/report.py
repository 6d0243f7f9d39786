"""From per-request records to the numbers a router is judged by, shared by `bench serve` and
`simulate` so a real run and a simulated one are summarised by the same code.

A record is a dict: arrival_s, prompt_tokens, output_tokens, cached_tokens, ttft_ms, tpot_ms,
e2e_ms, optionally itl_ms (list), worker, error (None when it succeeded).

Goodput follows DistServe: the highest request rate at which at least 90% of requests meet
both SLOs. A sweep measures attainment at discrete rates; `goodput` interpolates linearly
between the highest passing rate and the next (failing) one, since attainment falls
continuously between them. A run at a single rate measures no goodput: its report says
"attainment at R" and leaves goodput null.
"""

import gzip
import json
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np

TARGET = 0.9
CDF_POINTS = 101
HEADLINE = (
    "slo_attainment",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "tpot_p99_ms",
    "e2e_p50_ms",
    "cached_token_ratio",
    "throughput_rps",
    "throughput_tok_s",
    "errors",
    "error_kinds",
)


def meets_slo(r: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """Both SLOs met; a failed request is a miss, and a one-token answer has no TPOT to miss."""
    if r.get("error") or r.get("ttft_ms") is None:
        return False
    tpot = r.get("tpot_ms")
    return r["ttft_ms"] <= slo_ttft_ms and (tpot is None or tpot <= slo_tpot_ms)


def tpot_ms(ttft_ms: float, e2e_ms: float, output_tokens: int) -> float | None:
    """Mean time per output token after the first."""
    return (e2e_ms - ttft_ms) / (output_tokens - 1) if output_tokens > 1 else None


def percentiles(values: list[float], name: str) -> dict:
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    out = {}
    for p in (50, 90, 99):
        out[f"{name}_p{p}_ms"] = float(np.percentile(arr, p)) if arr.size else None
    out[f"{name}_mean_ms"] = float(arr.mean()) if arr.size else None
    return out


def quantiles(values: list[float]) -> list[float]:
    """CDF_POINTS evenly spaced quantiles: enough to draw a CDF, small enough for JSON."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    return np.quantile(arr, np.linspace(0, 1, CDF_POINTS)).tolist() if arr.size else []


def summarize(records: list[dict], slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """Throughput, latency percentiles, SLO attainment and prefix hits of one run.

    Throughput is over the span from the first arrival to the last completion; the
    cached-token ratio is over successful requests (what the workers reported as hits).
    """
    ok = [r for r in records if not r.get("error") and r.get("ttft_ms") is not None]
    span = 0.0
    if ok:
        start = min(r["arrival_s"] for r in records)
        span = max(r["arrival_s"] + r["e2e_ms"] / 1000.0 for r in ok) - start
    met = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records)
    prompt = sum(r["prompt_tokens"] for r in ok)
    output = sum(r["output_tokens"] for r in ok)
    itl = [x for r in ok for x in r.get("itl_ms") or ()]
    out = {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_kinds": dict(Counter(str(r["error"]).split(":")[0] for r in records if r.get("error"))),
        "span_s": span,
        "throughput_rps": len(ok) / span if span > 0 else 0.0,
        "throughput_tok_s": output / span if span > 0 else 0.0,
        "slo_attainment": met / len(records) if records else 0.0,
        "slo_met_rps": met / span if span > 0 else 0.0,
        "cached_token_ratio": sum(r["cached_tokens"] for r in ok) / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "output_tokens": output,
    }
    for name in ("ttft", "tpot", "e2e"):
        out.update(percentiles([r.get(f"{name}_ms") for r in ok], name))
    if itl:
        out.update(percentiles(itl, "itl"))
    out["cdf"] = {name: quantiles([r.get(f"{name}_ms") for r in ok]) for name in ("ttft", "tpot", "e2e")}
    if itl:
        out["cdf"]["itl"] = quantiles(itl)
    workers = Counter(r.get("worker") for r in ok if r.get("worker"))
    if workers:
        counts = list(workers.values())
        out["workers_used"] = len(workers)
        out["worker_imbalance"] = max(counts) / (sum(counts) / len(counts))
    return out


def run_line(run: dict) -> str:
    """One run as a progress line: attainment, latencies and hits of the requests that
    succeeded (none: said so, not zeros), and its errors by kind."""
    head = f"attainment {run['slo_attainment']:.3f}, "
    if run["completed"]:
        head += (
            f"ttft p50 {run['ttft_p50_ms']:.0f} ms, tpot p50 {run['tpot_p50_ms'] or 0:.1f} ms, "
            f"cached {run['cached_token_ratio']:.2f}, "
        )
    else:
        head += "no request succeeded, "
    return head + f"errors {run['errors']}" + (f" {run['error_kinds']}" if run["errors"] else "")


def goodput(points: list[tuple[float, float]], target: float = TARGET) -> tuple[float, str]:
    """(goodput in req/s, how it was found) from (rate, attainment) pairs.

    `interpolated`: between the highest passing rate and the next rate above it;
    `at_highest_rate`: every swept rate passed, so goodput is at least the highest;
    `below_lowest_rate`: nothing passed (reported as 0).
    """
    pts = sorted(points)
    passing = [i for i, (_, a) in enumerate(pts) if a >= target]
    if not passing:
        return 0.0, "below_lowest_rate"
    i = passing[-1]
    if i == len(pts) - 1:
        return pts[i][0], "at_highest_rate"
    (r0, a0), (r1, a1) = pts[i], pts[i + 1]
    return r0 + (a0 - target) / (a0 - a1) * (r1 - r0), "interpolated"


def reference_rate(series: dict[str, list[dict]], target: float = TARGET) -> float:
    """The rate policies are compared at: the highest swept rate at which some policy still
    meets the target (where the differences between policies show), else the lowest rate."""
    rates = sorted({r["rate_rps"] for runs in series.values() for r in runs})
    good = [r["rate_rps"] for runs in series.values() for r in runs if r["slo_attainment"] >= target]
    shared = [x for x in rates if all(any(r["rate_rps"] == x for r in runs) for runs in series.values())]
    candidates = [x for x in shared if x <= max(good)] if good else shared[:1]
    return max(candidates) if candidates else rates[0]


def single_rate(report: dict) -> bool:
    """Every entry ran at one rate: there is attainment at that rate and no goodput."""
    return all(len({r["rate_rps"] for r in e["runs"]}) == 1 for e in report["policies"].values())


def entry(runs: list[dict], at_rate: float) -> dict:
    """One policy's (or target's) block: goodput from its sweep (None from a single rate) plus
    headline metrics at `at_rate`."""
    if len({r["rate_rps"] for r in runs}) == 1:
        g, method = None, "single_rate"
    else:
        g, method = goodput([(r["rate_rps"], r["slo_attainment"]) for r in runs])
    ref = min(runs, key=lambda r: abs(r["rate_rps"] - at_rate))
    head = {k: ref.get(k) for k in HEADLINE}
    return {
        "goodput_rps": g,
        "goodput_method": method,
        "at_rate_rps": ref["rate_rps"],
        **head,
        "runs": sorted(runs, key=lambda r: r["rate_rps"]),
    }


def build(series: dict[str, list[dict]], meta: dict) -> dict:
    """The report both commands write: metadata, the compared rate, one entry per label."""
    at = reference_rate(series)
    return {
        **meta,
        "reference_rate_rps": at,
        "target_attainment": TARGET,
        "policies": {label: entry(runs, at) for label, runs in series.items()},
    }


def _clean(x):
    """JSON has no NaN or inf: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def read_json(path: str | Path) -> dict:
    """A report, from `path` or, where only that exists, its gzipped `path.gz` (bench/results
    keeps reports over 100 KB gzipped)."""
    p = Path(path)
    if p.suffix != ".gz" and not p.exists() and p.with_name(p.name + ".gz").exists():
        p = p.with_name(p.name + ".gz")
    if p.suffix == ".gz":
        with gzip.open(p, "rt") as f:
            return json.load(f)
    return json.loads(p.read_text())


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(_clean(report), f, indent=1)
        f.write("\n")


def print_table(report: dict, out) -> None:
    """A one-line-per-entry summary for the terminal; its first column is named for what it
    holds (a policy, or the target a benchmark ran against)."""
    rate = report["reference_rate_rps"]
    cols = (
        "slo_attainment",
        "errors",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "tpot_p50_ms",
        "tpot_p90_ms",
        "cached_token_ratio",
        "throughput_tok_s",
    )
    if single_rate(report):
        print(f"attainment at {rate:.4g} req/s (one rate: no goodput; --sweep R1,R2,... measures it):", file=out)
    else:
        cols = ("goodput_rps", *cols)
        print(f"goodput from the sweep; the other columns at {rate:.4g} req/s:", file=out)
    key = "target" if report.get("kind") == "bench-serve" else "policy"
    width = max([len(key), *map(len, report["policies"])]) + 2
    print(f"{key:<{width}}" + "".join(f"{c:>19}" for c in cols), file=out)
    for label, e in report["policies"].items():
        cells = "".join(f"{e.get(c):>19.4g}" if isinstance(e.get(c), (int, float)) else f"{'-':>19}" for c in cols)
        print(f"{label:<{width}}" + cells, file=out)
    for label, e in report["policies"].items():
        if e.get("errors"):
            print(f"{label}: {e['errors']} requests failed at {rate:.4g} req/s: {e.get('error_kinds')}", file=out)


def publish(series: dict[str, list[dict]], meta: dict, out: str) -> dict:
    """Build the report, draw its plots next to `out`, write it and print its table: the last
    step of every command that writes one."""
    from bench.plots import plot_paths, plot_report

    report = build(series, meta)
    report["plots"] = plot_paths(out)
    write_json(out, report)  # first: a plot that fails still leaves the numbers
    plot_report(report, out)
    print_table(report, sys.stderr)
    print(f"wrote {out} and {', '.join(report['plots'])} ({meta['wall_s']:.0f} s)", file=sys.stderr)
    return report
