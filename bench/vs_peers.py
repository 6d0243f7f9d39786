"""`python -m bench.vs_peers`: kvgate against the peers a user would pick instead, side by side
in one run, in front of the same fleet of `sim` workers.

    python -m bench.vs_peers --workloads multi-turn,shared-prefix,skewed --rates 8,12,16,20,24 \\
        --duration 20 --out bench/results/vs-peers.json

The fleet: `--workers` `kvgate worker --executor sim` processes with the `--profile` cost model
and `--num-blocks` KV blocks each (too few for the working set, so routing decides what stays
cached). The routers: kvgate with each of `--policies`, sglang-router and vllm-router with
`cache_aware`. Prompts go as text (sglang-router takes no token ids): the seeded workloads'
token ids written as words the workers' tokenizer reads back to one token each
(`bench.prompt_text`), so equal prefixes are equal text and every prompt is as long as the
simulator's. The peers are
installed from PyPI into venvs of their own beside the repository (`../.venv-sglang-router`,
`../.venv-vllm-router`; created when missing, never part of the repository). Each router runs
alone in front of the fleet; before each rate every worker's prefix cache is emptied (`POST
/kv/reset`), so each rate starts cold with the same seeded requests. Per router and workload
the rates run in ascending order and stop at the first one below 90% SLO attainment; when every
rate passes, the rate grows by half until one fails (`--max-extra` times), so every goodput is
found, not bounded; `--refine` bisections between the last passing and the first failing rate
then narrow the interpolation.

Then (or only, with `--workloads ""`), at `--low-rate`: what each router adds to TTFT over
sending straight to the workers and its CPU per request (`bench.router_overhead`), with a PNG
(`<out stem>-overhead.png`).

Output: one report per workload (`<out stem>-<workload>.json` with attainment-vs-rate and
goodput plots, as `kvgate bench serve` writes), and `--out` with every router's goodput per
workload, the ratio of kvgate's best to the best peer's, the overhead table, the simulator's
goodput for each kvgate policy at the same rates against the real fleet's
(`simulator_fidelity`, `bench/peer_fidelity.py`: as measured and rescaled to each run's own worker
steps; `--fidelity-only` adds it to an existing report), and a PNG of goodput bars next to it.
"""

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import report as rep
from bench import router_overhead
from bench.loadgen import run_loop, run_rate
from bench.peer_fidelity import add_fidelity, step_mark, step_speed
from bench.proc_cpu import cpu_s
from bench.prompt_text import as_text
from bench.workloads import BenchRequest, WorkloadConfig
from gateway.procs import ROOT, Proc, Worker, free_port, start_gateway, stop_all
from workers.model_store import load_tokenizer, served_name

PEERS = {"sglang-router": "sglang-router", "vllm-router": "vllm-router"}
PEER_POLICY = "cache_aware"


def ensure_venv(package: str, venv_dir: Path) -> Path:
    """A venv holding `package` from PyPI, made on first use; returns its directory."""
    python = venv_dir / "bin" / "python"
    if not python.exists():
        print(f"installing {package} into {venv_dir}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], check=True)
    probe = subprocess.run([str(python), "-m", "pip", "show", "-q", package], capture_output=True)
    if probe.returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", package], check=True)
    return venv_dir


def peer_argv(name: str, venv: Path, port: int, urls: list[str]) -> list[str]:
    """The command line that starts peer `name` in front of `urls`, its metrics on a free port
    of their own (both default to 29000, which another run on the machine may hold)."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", PEER_POLICY]
    common += ["--prometheus-port", str(free_port())]
    if name == "sglang-router":
        return [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common]
    return [str(venv / "bin" / "vllm-router"), *common]


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.token = secrets.token_hex(16)
        self.slo = (args.slo_ttft_ms, args.slo_tpot_ms)
        self.workers: list[Worker] = []
        self.text = as_text(load_tokenizer(args.model))

    def start_fleet(self, redis: str | None = None) -> list[str]:
        """Start the sim workers; with `redis`, each also publishes its KV events and
        registration there (gateways on that Redis read them instead of following each worker)."""
        a = self.args
        extra = ["--sim-profile", a.profile, "--num-blocks", str(a.num_blocks), "--internal-token", self.token]
        self.workers = [
            Worker("sim", f"sim{i}", redis=redis, extra=extra, model=a.model, log_dir=a.log_dir)
            for i in range(a.workers)
        ]
        for w in self.workers:
            w.ready(300)
        return [w.url for w in self.workers]

    def start_router(self, label: str, urls: list[str]) -> Proc:
        a = self.args
        if label.startswith("kvgate-"):
            proc = start_gateway(
                urls,
                label.removeprefix("kvgate-"),
                name=label,
                log_dir=a.log_dir,
                extra=[
                    "--internal-token",
                    self.token,
                    "--slo-ttft-ms",
                    str(a.slo_ttft_ms),
                    "--slo-tpot-ms",
                    str(a.slo_tpot_ms),
                ],
            )
            proc.wait_ready(timeout=120)
            proc.wait_healthy(len(urls), timeout=30, what=f"{label} to see every worker")
            return proc
        venv = ensure_venv(PEERS[label], Path(a.venv_dir) / f".venv-{label}")
        port = free_port()
        proc = Proc(label, peer_argv(label, venv, port, urls), port, a.log_dir)
        proc.wait_ready("/health", timeout=120)
        return proc

    def reset(self) -> None:
        for w in self.workers:
            w.reset_cache()

    def measure(
        self,
        urls: list[str],
        wl: WorkloadConfig,
        pid: int | None,
        pick: Callable[[int, BenchRequest], int] | None = None,
    ) -> dict:
        """One rate against `urls` (`pick`: which one a request goes to, as `loadgen.run_rate`):
        the summary, with the router's CPU seconds per request."""
        self.reset()
        marks = [step_mark(w.url, self.token) for w in self.workers]
        before = cpu_s(pid) if pid else 0.0
        records = run_loop(
            run_rate(
                urls, wl, served_name(self.args.model), self.slo, timeout=self.args.timeout, text=self.text, pick=pick
            )
        )
        run = rep.summarize(records, *self.slo)
        for r in records:
            r.pop("itl_ms", None)  # summarized above; per token, they were most of the report's megabytes
        run.update(
            rate_rps=wl.rate,
            records=records,
            rejected=sum(1 for r in records if (r["error"] or "").startswith("http 429")),
            router_cpu_s_per_request=(cpu_s(pid) - before) / max(1, len(records)) if pid else None,
            step_speed=step_speed(self.args.profile, [(w.url, m) for w, m in zip(self.workers, marks)], self.token),
        )
        return run

    def sweep(self, label: str, router: Proc, wl: WorkloadConfig) -> list[dict]:
        """Ascending rates until attainment drops below the target; past the list, +50% steps;
        while nothing has passed, -1/3 steps below it (as many as `--max-extra`: a router
        failing the first rate had no goodput to compare); then `--refine` bisections between
        the last rate that passed and the first that failed, so goodput is interpolated over a
        gap of a fraction of the grid's step (the knee is steep: across a whole step, one run's
        noise moved it by 10-20%)."""
        a, runs = self.args, []
        rates = [float(r) for r in a.rates.split(",")]
        extra = 0
        while rates:
            run = self.run_rate(label, router, wl, rates.pop(0))
            runs.append(run)
            if run["slo_attainment"] < rep.TARGET:
                break
            if not rates and extra < a.max_extra:
                extra += 1
                rates.append(round(run["rate_rps"] * 1.5, 1))
        for _ in range(a.max_extra):
            if any(r["slo_attainment"] >= rep.TARGET for r in runs):
                break
            runs.append(self.run_rate(label, router, wl, round(runs[-1]["rate_rps"] * 2 / 3, 1)))
        for _ in range(a.refine):
            bracket = knee(runs)
            if bracket is None:
                break
            runs.append(self.run_rate(label, router, wl, round(sum(bracket) / 2, 1)))
        return sorted(runs, key=lambda r: r["rate_rps"])

    def run_rate(self, label: str, router: Proc, wl: WorkloadConfig, rate: float) -> dict:
        """`measure` at one rate through `router`, with a progress line."""
        run = self.measure([router.url], wl.with_rate(rate), router.popen.pid)
        print(
            f"  {label} {wl.name} {rate:g} req/s: attainment {run['slo_attainment']:.3f}, "
            f"ttft p50 {run['ttft_p50_ms'] or 0:.0f} ms, errors {run['errors']}",
            file=sys.stderr,
            flush=True,
        )
        return run


def knee(runs: list[dict], min_gap: float = 1.0) -> tuple[float, float] | None:
    """(the highest passing rate, the lowest failing rate above it) when both exist and are
    more than `min_gap` req/s apart, else None."""
    passed = [r["rate_rps"] for r in runs if r["slo_attainment"] >= rep.TARGET]
    if not passed:
        return None
    above = [r["rate_rps"] for r in runs if r["rate_rps"] > max(passed)]
    if not above or min(above) - max(passed) <= min_gap:
        return None
    return max(passed), min(above)


def labels_of(args: argparse.Namespace) -> list[str]:
    return [f"kvgate-{p}" for p in args.policies.split(",") if p] + [p for p in args.peers.split(",") if p]


def summarize_all(reports: dict[str, dict], labels: list[str]) -> dict:
    """Per workload: goodput per router, kvgate's best, the best peer and their ratio."""
    out = {}
    for wl, report in reports.items():
        good = {
            label: report["policies"][label]["goodput_rps"] or 0.0 for label in labels if label in report["policies"]
        }
        methods = {label: report["policies"][label]["goodput_method"] for label in good}
        ours = max((g, k) for k, g in good.items() if k.startswith("kvgate-"))
        peers = [(g, k) for k, g in good.items() if not k.startswith("kvgate-")]
        best_peer = max(peers) if peers else (0.0, None)
        out[wl] = {
            "goodput_rps": good,
            "goodput_method": methods,
            "kvgate_best": ours[1],
            "best_peer": best_peer[1],
            "ratio": ours[0] / best_peer[0] if best_peer[0] else None,
        }
    return out


def plot_summary(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(summary)
    labels = sorted(
        {k for s in summary.values() for k in s["goodput_rps"]}, key=lambda k: (not k.startswith("kvgate"), k)
    )
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(workloads)), 4.5))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        xs = [j + i * width for j in range(len(workloads))]
        ys = [summary[w]["goodput_rps"].get(label) or 0.0 for w in workloads]
        ax.bar(xs, ys, width, label=label)
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.3g}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("goodput (req/s at 90% SLO attainment)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("kvgate vs sglang-router and vllm-router (cache_aware), same sim fleet")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.vs_peers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workloads", default="multi-turn,shared-prefix,skewed")
    p.add_argument("--policies", default="slo_goodput,prefix_affinity,round_robin", help="kvgate policies")
    p.add_argument("--peers", default="sglang-router,vllm-router")
    p.add_argument("--rates", default="8,12,16,20,24", help="ascending request rates (req/s)")
    p.add_argument("--max-extra", type=int, default=3, help="+50%% rates past the list while all pass")
    p.add_argument("--refine", type=int, default=1, help="bisections between the last passing and first failing rate")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--model", default="smollm2-135m", help="the sim workers' tokenizer; prompts go as its text")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--profile", default="bench/profiles/h200-llama8b-kvgate-eager.json")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument(
        "--low-rate",
        type=float,
        default=2.0,
        help="rate of the overhead measurement, all targets together (0: skip it)",
    )
    p.add_argument("--low-duration", type=float, default=60.0, help="seconds of arrivals per overhead run")
    p.add_argument(
        "--overhead-repeat",
        type=int,
        default=1,
        help="runs of the overhead measurement (TTFT figures over every run's requests) and of each "
        "router's CPU run (the median)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    p.add_argument("--venv-dir", default=str(ROOT.parent), help="where the peers' venvs live")
    p.add_argument("--log-dir", help="process logs (default: a temp dir per process)")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--fidelity-only",
        action="store_true",
        help="only add the simulator's goodput for the kvgate policies to the existing --out",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.fidelity_only:
        add_fidelity(args.out)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    labels = labels_of(args)
    for label in labels:
        if not label.startswith("kvgate-"):
            ensure_venv(PEERS[label], Path(args.venv_dir) / f".venv-{label}")
    t0 = time.perf_counter()
    bench = Bench(args)
    stem = args.out.removesuffix(".json")
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    reports, overhead = {}, {}
    try:
        urls = bench.start_fleet()
        for name in [w for w in args.workloads.split(",") if w]:
            wl = WorkloadConfig(name=name, duration_s=args.duration, seed=0)
            series = {}
            for label in labels:
                router = bench.start_router(label, urls)
                try:
                    series[label] = bench.sweep(label, router, wl)
                finally:
                    stop_all([router])
            meta = {
                "kind": "bench-vs-peers",
                "title": f"{name}: kvgate vs peers, {args.workers} sim workers",
                "command": "python -m bench.vs_peers " + " ".join(argv),
                "slo_ttft_ms": args.slo_ttft_ms,
                "slo_tpot_ms": args.slo_tpot_ms,
                "workload": name,
                "wall_s": time.perf_counter() - t0,
            }
            reports[name] = rep.publish(series, meta, f"{stem}-{name}.json")
        if args.low_rate > 0:
            overhead = router_overhead.overhead(bench, labels, urls)
    finally:
        stop_all(bench.workers)
    summary = summarize_all(reports, labels)
    out = {
        "kind": "bench-vs-peers-summary",
        "command": "python -m bench.vs_peers " + " ".join(argv),
        "workers": args.workers,
        "num_blocks": args.num_blocks,
        "profile": args.profile,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "duration_s": args.duration,
        "peer_policy": PEER_POLICY,
        "workloads": summary,
        "overhead_low_load": overhead,
        "reports": {w: f"{Path(stem).name}-{w}.json" for w in reports},
        "wall_s": time.perf_counter() - t0,
    }
    png = stem + ".png"
    if summary:
        plot_summary(summary, png)
        out["plot"] = Path(png).name
    if overhead:
        router_overhead.plot_overhead(overhead, stem + "-overhead.png")
        out["overhead_plot"] = Path(stem + "-overhead.png").name
    Path(args.out).write_text(json.dumps(rep._clean(out), indent=1))
    print(
        json.dumps({w: {"ratio": s["ratio"], **s["goodput_rps"]} for w, s in summary.items()}, indent=1),
        file=sys.stderr,
    )
    add_fidelity(args.out)
    print(f"wrote {args.out} and its plots", file=sys.stderr)


if __name__ == "__main__":
    main()
