"""Gateway CPU per proxied request, A/B between checkouts: 4 sim workers (the h200-llama8b eager
profile); per round and per `--code` checkout a gateway in front of them, a Poisson load of
256-random-token text prompts (as `bench.vs_peers`'s low-load run) and its CPU time from
`bench.proc_cpu.cpu_s` (every thread's schedstat, nanoseconds), its context switches per request and
the TTFT it adds over the same requests sent straight to the workers. Checkouts alternate
round by round, so load from elsewhere on a shared host falls on each alike; medians at the end.

    PYTHONPATH=. python experiments/gateway_cpu.py --code . --code ../base [--rounds 3] [--output-len 1,16]

(`../base`: another checkout, e.g. `git worktree add --detach ../base main`.)
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench import router_overhead, vs_peers
from bench.proc_cpu import cpu_s
from bench.loadgen import run_loop, run_rate
from bench.workloads import WorkloadConfig
from gateway import procs
from workers.model_store import served_name


def switches(pid: int) -> int:
    """Context switches of every thread of `pid`, voluntary and not."""

    def count(status: str) -> int:
        return sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line)

    return sum(_task_field(pid, tid, "status", count) for tid in _tasks(pid))


def _tasks(pid: int) -> list[str]:
    return os.listdir(f"/proc/{pid}/task")


def _task_field(pid: int, tid: str, name: str, parse) -> int:
    try:
        return parse(Path(f"/proc/{pid}/task/{tid}/{name}").read_text())
    except (OSError, ValueError, IndexError):
        return 0  # a thread that ended since the listing


def gateway_argv(code: str) -> list[str]:
    """`kvgate gateway` run from checkout `code`."""
    path = str(Path(code).resolve())
    boot = f"import sys, runpy; sys.path.insert(0, {path!r}); runpy.run_module('gateway.cli', run_name='__main__')"
    return [sys.executable, "-c", boot]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--code", action="append", help="a checkout to run the gateway from (repeat; default: this one)")
    p.add_argument("--policy", default="prefix_affinity")
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--output-len", default="16", help="output tokens; several (1,16) give the cost per token")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    codes, lens = a.code or ["."], [int(n) for n in a.output_len.split(",")]
    bench = vs_peers.Bench(vs_peers.parser().parse_args(["--out", "unused.json"]))
    model = served_name(bench.args.model)

    def run(urls: list[str], n: int) -> list[dict]:
        bench.reset()
        wl = WorkloadConfig(name="random", rate=a.rate, duration_s=a.duration, input_len=256, output_len=n, seed=7)
        return run_loop(run_rate(urls, wl, model, bench.slo, timeout=120, text=bench.text))

    results: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    urls = bench.start_fleet()
    try:
        direct = {n: np.array([r["ttft_ms"] for r in run(urls, n)]) for n in lens}
        for _ in range(a.rounds):
            for code in codes:
                procs.KVGATE[:] = gateway_argv(code)
                g = bench.start_router(f"kvgate-{a.policy}", urls)
                time.sleep(router_overhead.SETTLE_S)
                for n in lens:
                    c0, s0 = cpu_s(g.popen.pid), switches(g.popen.pid)
                    recs = run([g.url], n)
                    cpu, sw = (cpu_s(g.popen.pid) - c0) / len(recs), (switches(g.popen.pid) - s0) / len(recs)
                    ttft = np.array([r["ttft_ms"] for r in recs if r["ttft_ms"] is not None])
                    added = [float(np.percentile(ttft, q) - np.percentile(direct[n], q)) for q in (50, 90)]
                    results.setdefault((code, n), []).append((1000 * cpu, sw, *added))
                    print(
                        f"{code} {n} tokens: {1000 * cpu:.2f} ms CPU, {sw:.1f} switches, +{added[0]:.2f}/+{added[1]:.2f} ms",
                        flush=True,
                    )
                procs.stop_all([g])
    finally:
        procs.stop_all(bench.workers)
    for (code, n), runs in results.items():
        cpu, sw, p50, p90 = (statistics.median(col) for col in zip(*runs))
        print(
            f"{code}, {n} output tokens: CPU {cpu:.2f} ms/request ({[round(r[0], 2) for r in runs]}), "
            f"{sw:.1f} context switches/request, added TTFT p50 {p50:+.2f} ms, p90 {p90:+.2f} ms"
        )


if __name__ == "__main__":
    main()
