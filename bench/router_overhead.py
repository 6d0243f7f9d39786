"""What a router costs at low load, for `bench.vs_peers`: the TTFT it adds over sending straight
to the workers, and its process CPU time per request.

At `--low-rate` with 256-token text prompts: all routers running, requests take turns between
the direct path (client-side round robin over the workers) and each router in one run
(`--overhead-repeat` runs, every request pooled), so every target sees the same host over the
same seconds; then each router alone for its CPU (every thread's, `bench.proc_cpu`), the
median of `--overhead-repeat` runs, the routers taking turns. A PNG beside the report
(`plot_overhead`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import TYPE_CHECKING

from bench import report as rep
from bench.loadgen import run_loop, run_rate
from bench.workloads import WorkloadConfig
from gateway.procs import Proc, stop_all
from workers.model_store import served_name

if TYPE_CHECKING:
    from bench.vs_peers import Bench

SETTLE_S = 3.0  # a router's start-up work (first polls, snapshots) is over before its CPU is counted


def overhead(bench: Bench, labels: list[str], urls: list[str]) -> dict:
    """What each router adds to TTFT over sending straight to the workers (`overhead_once`,
    `--overhead-repeat` runs with every router started once for all of them; each figure
    over every run's requests together, `runs` each run's own), and its CPU per request:
    the median of `--overhead-repeat` runs of each router alone (`cpu_ms`), the routers
    taking turns, so the host's drift falls on each alike (one run apiece moved by more
    than the routers differ: 5.1-6.7 ms for the same gateway)."""
    routers = {label: bench.start_router(label, urls) for label in labels}
    try:
        time.sleep(SETTLE_S)
        runs = [overhead_once(bench, routers, urls, k) for k in range(bench.args.overhead_repeat)]
    finally:
        stop_all(list(routers.values()))
    cpu: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(bench.args.overhead_repeat):
        for label in labels:
            cpu[label].append(cpu_ms(bench, label, urls))
    direct = [t for r in runs for t in r["direct"]]
    out: dict = {"direct": rep.percentiles(direct, "ttft")}
    for label in labels:
        ttft = [t for r in runs for t in r[label]]
        out[label] = {
            **added(ttft, direct),
            "requests": len(ttft),
            "cpu_ms_per_request": statistics.median(cpu[label]),
            "cpu_ms_runs": cpu[label],
            "runs": [added(r[label], r["direct"]) for r in runs],
        }
    out["load_average"] = os.getloadavg()
    return out


def low_load(args: argparse.Namespace, output_len: int = 16, seed: int = 7) -> WorkloadConfig:
    return WorkloadConfig(
        name="random", rate=args.low_rate, duration_s=args.low_duration, input_len=256, output_len=output_len, seed=seed
    )


def overhead_once(bench: Bench, routers: dict[str, Proc], urls: list[str], k: int = 0) -> dict[str, list[float]]:
    """The TTFTs of one run at `--low-rate` in all, by target, whose requests take turns:
    straight to a worker (client-side round robin), then through each router, and again, so
    every target sees the same host over the same seconds (routers measured one after
    another drifted with the host's load by more than they add). Answers are 2 tokens, so
    the direct path rarely finds its worker still busy with an earlier request; run `k`
    starts with empty caches and prompts of its own (seed 7 + k), so it hits nothing an
    earlier run left."""
    bench.reset()
    targets = ["direct", *routers]
    order = [u if t == "direct" else routers[t].url for u in urls for t in targets]
    records = run_loop(
        run_rate(
            order,
            low_load(bench.args, output_len=2, seed=7 + k),
            served_name(bench.args.model),
            bench.slo,
            timeout=bench.args.timeout,
            text=bench.text,
        )
    )
    failed = [r["error"] for r in records if r["error"]]
    if failed:
        raise RuntimeError(f"{len(failed)} low-load requests failed, first: {failed[0]}")
    return {t: [r["ttft_ms"] for r in records[n :: len(targets)]] for n, t in enumerate(targets)}


def cpu_ms(bench: Bench, label: str, urls: list[str]) -> float:
    """The router's CPU ms per request (every thread's) in a low-load run of its own: a
    kvgate gateway reads every KV event of the fleet, so beside other routers' traffic it
    would pay for theirs."""
    router = bench.start_router(label, urls)
    try:
        time.sleep(SETTLE_S)
        return 1000.0 * bench.measure([router.url], low_load(bench.args), router.popen.pid)["router_cpu_s_per_request"]
    finally:
        stop_all([router])


def added(ttft: list[float], direct: list[float]) -> dict:
    """A router's TTFT percentiles and what they add over the direct requests' same percentile."""
    own, base = rep.percentiles(ttft, "ttft"), rep.percentiles(direct, "ttft")
    return {
        **own,
        "added_ttft_p50_ms": own["ttft_p50_ms"] - base["ttft_p50_ms"],
        "added_ttft_p90_ms": own["ttft_p90_ms"] - base["ttft_p90_ms"],
    }


def plot_overhead(overhead: dict, path: str) -> None:
    """Added TTFT (p50, p90) and router CPU per request, one bar group per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [k for k in overhead if k not in ("direct", "load_average")]
    fig, (lat, cpu) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (key, name) in enumerate([("added_ttft_p50_ms", "p50"), ("added_ttft_p90_ms", "p90")]):
        xs = [j + i * 0.4 for j in range(len(labels))]
        ys = [overhead[k][key] for k in labels]
        lat.bar(xs, ys, 0.4, label=f"added TTFT {name}")
        for x, y in zip(xs, ys):
            lat.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=7)
    lat.set_xticks([j + 0.2 for j in range(len(labels))], labels, fontsize=7, rotation=20, ha="right")
    lat.set_ylabel("ms over calling the workers directly")
    lat.axhline(0, color="black", linewidth=0.5)
    lat.legend(fontsize=8)
    ys = [overhead[k]["cpu_ms_per_request"] for k in labels]
    cpu.bar(range(len(labels)), ys)
    for x, y in enumerate(ys):
        cpu.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=7)
    cpu.set_xticks(range(len(labels)), labels, fontsize=7, rotation=20, ha="right")
    cpu.set_ylabel("router CPU ms per request")
    load = overhead.get("load_average")
    fig.suptitle(
        "router cost at low load (256-token text prompts" + (f"; load average {load[0]:.1f}" if load else "") + ")"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
