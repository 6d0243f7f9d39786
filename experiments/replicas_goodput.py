"""slo_goodput behind several gateway replicas that share their state through Redis: SLO
attainment per rate, one run per `--fleet` (a checkout and a number of replicas), in front of
`bench.vs_peers`'s fleet (4 sim workers, the h200-llama8b eager profile, 1024 blocks each).
The client sends its requests to the replicas in turn (or sorted by size, `--split`); every worker's prefix cache is emptied
before each rate. JSON and a PNG of attainment against rate.

    PYTHONPATH=. python experiments/replicas_goodput.py --fleet .:1 --fleet .:2 --fleet ../base:2 \\
        --rates 16,19,21 --out bench/results/replicas-goodput.json

(`../base`: another checkout, e.g. `git worktree add --detach ../base main`.)
"""

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from bench import report as rep
from bench import vs_peers
from bench.proc_cpu import cpu_s
from bench.workloads import WorkloadConfig
from experiments.gateway_cpu import gateway_argv
from experiments.sim_grid import balancer
from gateway import procs


def replicas(
    bench: vs_peers.Bench, urls: list[str], code: str, n: int, redis: str, policy: str, args: list[str]
) -> list[procs.Proc]:
    """`n` gateway replicas run from checkout `code`, sharing their state through `redis`;
    `args`: the policy's KEY=VALUE arguments."""
    a = bench.args
    procs.KVGATE[:] = gateway_argv(code)
    extra = ["--internal-token", bench.token, "--slo-ttft-ms", str(a.slo_ttft_ms), "--slo-tpot-ms", str(a.slo_tpot_ms)]
    extra += [x for arg in args for x in ("--policy-arg", arg)]
    out = [
        procs.start_gateway(
            urls, policy, redis=redis, name=f"replica-{i}", log_dir=a.log_dir, extra=[*extra, "--replica-id", f"r{i}"]
        )
        for i in range(n)
    ]
    for g in out:
        g.wait_ready(timeout=120)
        g.wait_healthy(len(urls), timeout=30, what="every worker")
    return out


def commit(code: str) -> str:
    """The short commit checked out at `code`, with `+` where its tracked files differ from it."""
    git = ["git", "-C", code]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"]).returncode != 0
    return (head or code) + ("+" if dirty else "")


def plot(series: dict[str, list[dict]], path: str) -> None:
    """Attainment against rate per run; at a single rate, each configuration's rounds side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rates = {r["rate_rps"] for runs in series.values() for r in runs}
    if len(rates) == 1:
        configs: dict[str, list[float]] = {}
        for label, runs in series.items():
            configs.setdefault(label.split(" #")[0], []).append(runs[0]["slo_attainment"])
        for x, values in enumerate(configs.values()):
            ax.bar(x, sum(values) / len(values), color="lightsteelblue")
            ax.plot([x] * len(values), values, "ko", markersize=4)
        ax.set_xticks(range(len(configs)), list(configs), fontsize=8)
        ax.set_ylim(min(v for vs in configs.values() for v in vs) - 0.05, 1.0)
        ax.set_ylabel(f"SLO attainment at {rates.pop():g} req/s (bar: mean, dots: rounds)")
    else:
        for label, runs in series.items():
            ax.plot([r["rate_rps"] for r in runs], [r["slo_attainment"] for r in runs], marker="o", label=label)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.legend()
    ax.axhline(rep.TARGET, color="grey", linestyle=":", linewidth=1)
    ax.set_title("slo_goodput behind gateway replicas sharing state through Redis")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--fleet", action="append", required=True, help="CHECKOUT:REPLICAS[:KEY=VALUE...], policy arguments (repeat)"
    )
    p.add_argument("--policy", default="slo_goodput")
    p.add_argument("--workload", default="multi-turn")
    p.add_argument("--rates", default="16,19,21")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--log-dir")
    p.add_argument(
        "--workers-on-redis",
        action="store_true",
        help="the workers publish their KV events to the replicas' Redis, which the replicas read "
        "instead of following each worker's /kv/events",
    )
    p.add_argument(
        "--split",
        default="turns",
        help="how the client spreads requests over the replicas: turns, or size:T (prompts over T "
        "tokens to the first replica, the rest to the others: a balancer that sorts traffic)",
    )
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    bench = vs_peers.Bench(
        vs_peers.parser().parse_args(["--out", a.out, *(["--log-dir", a.log_dir] * bool(a.log_dir))])
    )
    rates = [float(r) for r in a.rates.split(",")]
    t0, series, rounds = time.perf_counter(), {}, Counter[str]()
    redis = procs.wait_redis(procs.start_redis(log_dir=a.log_dir))
    url = f"redis://127.0.0.1:{redis.port}/0"
    try:
        urls = bench.start_fleet(url if a.workers_on_redis else None)
        for spec in a.fleet:
            code, n, *args = spec.split(":")
            rounds[spec] += 1
            label = " ".join([f"{commit(code)} x{n}", *args]) + (f" #{rounds[spec]}" if a.fleet.count(spec) > 1 else "")
            gateways = replicas(bench, urls, code, int(n), url, a.policy, args)
            pick = balancer(a.split, len(gateways))
            try:
                runs = []
                for rate in rates:
                    wl = WorkloadConfig(name=a.workload, duration_s=a.duration, seed=0, rate=rate)
                    before = sum(cpu_s(g.popen.pid) for g in gateways)
                    run = bench.measure([g.url for g in gateways], wl, None, lambda i, br: pick(i, len(br.prompt)))
                    spent = sum(cpu_s(g.popen.pid) for g in gateways) - before
                    run["gateways_cpu_ms_per_request"] = 1000 * spent / max(1, len(run.pop("records")))
                    runs.append(run)
                    print(
                        f"{label} {rate:g} req/s: attainment {run['slo_attainment']:.3f}, "
                        f"gateways' CPU {run['gateways_cpu_ms_per_request']:.2f} ms/request",
                        file=sys.stderr,
                        flush=True,
                    )
                series[label] = runs
            finally:
                procs.stop_all(gateways)
    finally:
        procs.stop_all([*bench.workers, redis])
    png = a.out.removesuffix(".json") + ".png"
    plot(series, png)
    out = {
        "kind": "replicas-goodput",
        "command": "PYTHONPATH=. python experiments/replicas_goodput.py " + " ".join(sys.argv[1:]),
        "workload": a.workload,
        "policy": a.policy,
        "duration_s": a.duration,
        "workers_on_redis": a.workers_on_redis,
        "split": a.split,
        "goodput_rps": {
            label: rep.goodput([(r["rate_rps"], r["slo_attainment"]) for r in runs]) for label, runs in series.items()
        },
        "series": series,
        "plot": Path(png).name,
        "wall_s": time.perf_counter() - t0,
    }
    Path(a.out).write_text(json.dumps(rep._clean(out), indent=1))
    print(json.dumps(out["goodput_rps"], indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
