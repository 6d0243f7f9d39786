"""`python -m bench.fidelity`: how close the simulator comes to a real fleet, measured.

    python -m bench.fidelity --url http://127.0.0.1:8101 --url http://127.0.0.1:8102 \\
        --rates 1,2 --duration 40 --groups 2 --prefix-len 128 --question-len 32 --output-len 20 \\
        --out bench/results/fidelity.json

It calibrates the workers with probes (`kvgate calibrate`), runs the seeded workload at each
rate against them (client-side round robin, so the simulation can make the same assignment),
reads the steps each run made from the workers' step logs (GET /steps), and simulates every
run twice with the round_robin policy: with the probed profile, and with it rescaled to the
run's own steps (`kvgate calibrate --rescale`: the probes' shape, the run's speed). The JSON
holds, per rate, the real and both simulated TTFT and TPOT medians with their ratios; a PNG
shows them. The simulated workers get the real ones' pool, batch and length limits (/state).

`--warmup-s S` first serves S seconds of the same workload (another seed) at the highest rate,
unmeasured. A GPU worker's first half-minute under a new load ran its steps ~1.8x slower than
the same load later (bench/results/README.md, "warm-up"), so probes or runs on a cold worker
measure the warm-up, not the worker.
"""

import argparse
import json
import sys
import time

import httpx

from bench import calibrate
from bench.fleet_sim import FleetConfig, FleetSim
from bench.loadgen import run_loop, run_rate
from bench.report import summarize
from bench.sim_worker import SimConfig
from bench.workloads import WorkloadConfig, add_args, from_args, generate
from policies.registry import load_policy
from workers.internal_auth import internal_headers
from workers.kv.cost_model import CostModel
from workers.step_stats import StepRecord

LOOSE_SLO = (5000.0, 1000.0)  # the comparison is of latencies, not of attainment
METRICS = ("ttft_p50_ms", "tpot_p50_ms")


def run(urls: list[str], wl: WorkloadConfig, model: str | None) -> tuple[list[dict], list[StepRecord]]:
    """The workload's records from the real workers, and the steps they made meanwhile."""
    before = [calibrate.step_log(u)[0] for u in urls]
    records = run_loop(run_rate(urls, wl, model, LOOSE_SLO))
    return records, [s for u, n in zip(urls, before) for s in calibrate.step_log(u, n)[1]]


def sim_config(url: str) -> SimConfig:
    """A simulated worker with the real one's pool, batching and length limits."""
    s = httpx.get(url + "/state", timeout=10, headers=internal_headers()).json()
    return SimConfig(
        model_id=s["model"],
        block_size=s["block_size"],
        num_blocks=s["total_blocks"],
        max_batched_tokens=s["max_batched_tokens"],
        max_num_seqs=s["max_num_seqs"],
        max_model_len=s["max_model_len"],
    )


def simulate(profile: dict, wl: WorkloadConfig, workers: int, sim: SimConfig) -> dict:
    """The same workload on `workers` simulated workers with `profile`, round robin."""
    fleet = FleetConfig(
        workers=workers,
        sim=sim,
        cost=CostModel.from_json(profile),
        request_overhead_ms=profile.get("request_overhead_ms", 0.0),
    )
    return summarize(FleetSim(load_policy("round_robin"), fleet).run(generate(wl), wl.duration_s), *LOOSE_SLO)


def compare(
    profile: dict, wl: WorkloadConfig, records: list[dict], steps: list[StepRecord], workers: int, sim: SimConfig
) -> dict:
    """Real against simulated medians, with the probed profile and with it rescaled to `steps`."""
    real = summarize(records, *LOOSE_SLO)
    now = calibrate.rescale(profile, steps)
    out = {
        "rate_rps": wl.rate,
        "requests": real["requests"],
        "errors": real["errors"],
        "real": {k: real[k] for k in (*METRICS, "cached_token_ratio")},
        "speed_factors": now["rescaled"],
    }
    for label, p in (("probed", profile), ("rescaled", now)):
        s = simulate(p, wl, workers, sim)
        out[label] = {k: s[k] for k in (*METRICS, "cached_token_ratio", "errors")}
        out[label]["ratio"] = {k: s[k] / real[k] for k in METRICS if s[k] and real[k]}
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    runs = report["runs"]
    for ax, metric in zip(axes, METRICS):
        for k, label in enumerate(("real", "probed", "rescaled")):
            xs = [i + (k - 1) * 0.27 for i in range(len(runs))]
            ax.bar(xs, [r[label][metric] or 0 for r in runs], width=0.27, label=label)
        ax.set_xticks(range(len(runs)), [f"{r['rate_rps']:g} req/s" for r in runs])
        ax.set_ylabel(metric.replace("_", " "))
        ax.legend()
    fig.suptitle(report.get("title", "real fleet against simulation"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.fidelity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", action="append", required=True, help="a running worker (repeatable)")
    p.add_argument("--rates", required=True, help="comma-separated request rates (req/s), run in turn")
    add_args(p)
    p.add_argument("--lengths", default="16,32,64,128,256", help="calibration prefill lengths")
    p.add_argument("--batches", default="1,2,3,4,5,6", help="calibration decode batch sizes")
    p.add_argument("--decode-tokens", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup-s", type=float, default=0.0, help="serve this long at the highest rate first, unmeasured")
    p.add_argument("--title")
    p.add_argument("--out", required=True, help="report JSON; a .png beside it")
    args = p.parse_args(argv)
    urls = [u.rstrip("/") for u in args.url]
    rates = [float(r) for r in args.rates.split(",")]
    t0 = time.perf_counter()
    sim = sim_config(urls[0])
    model = sim.model_id  # the served name: a worker answers only requests that name it
    warmup = {"seconds": args.warmup_s, "requests": 0, "errors": 0}
    if args.warmup_s > 0:
        warm = from_args(args, max(rates))
        done, _ = run(
            urls, WorkloadConfig(**{**warm.__dict__, "duration_s": args.warmup_s, "seed": warm.seed + 1000}), model
        )
        warmup.update(requests=len(done), errors=sum(r["error"] is not None for r in done))
    profile = calibrate.calibrate(
        urls,
        [int(x) for x in args.lengths.split(",")],
        [int(x) for x in args.batches.split(",")],
        args.decode_tokens,
        rounds=args.rounds,
    )
    runs = []
    for rate in rates:
        wl = from_args(args, rate)
        records, steps = run(urls, wl, model)
        runs.append(compare(profile, wl, records, steps, len(urls), sim))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    report = {
        "title": args.title or f"{model}: {len(urls)} workers, real against simulated",
        "command": "python -m bench.fidelity " + " ".join(argv if argv is not None else sys.argv[1:]),
        "warmup": warmup,
        "profile": profile,
        "runs": runs,
        "wall_s": time.perf_counter() - t0,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    plot(report, args.out[:-5] + ".png" if args.out.endswith(".json") else args.out + ".png")


if __name__ == "__main__":
    main()
