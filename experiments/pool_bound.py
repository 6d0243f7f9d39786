"""How far routing can lift goodput on a KV-pool-bound fleet (issue 16 point 7, multi-turn).

A request holds its private KV blocks (its prompt less the shared prefix, plus its output as it
grows: half of it on average) for its life, `max_tokens` decode steps; the fleet's pools less the
shared prefix's copies hold `room` tokens. By Little's law no router serves more than
`room / (footprint x life)` requests a second; a router that may refuse a tenth (goodput counts
a rate while 90% meet their SLOs) does best refusing the largest tenth, so its bound is that
with the smallest 90% of footprints. The simulator then runs `--policies` at `--rates` with the
pool as given and doubled: a pool-bound workload holds every rate with the doubled pool.

    PYTHONPATH=. python experiments/pool_bound.py --out /tmp/pool-bound.json
"""

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.fleet_sim import FleetConfig, FleetSim
from bench.report import summarize
from bench.sim_worker import SimConfig
from bench.workloads import WorkloadConfig, generate
from policies.registry import load_policy
from workers.kv.cost_model import CostModel


def bounds(args: argparse.Namespace, cost: CostModel) -> dict:
    """Little's-law ceilings (req/s) serving every request and the smallest 90%."""
    cfg = WorkloadConfig(name=args.workload, rate=args.rates[-1], duration_s=120, seed=0)
    shared, out = cfg.get("prefix_len") or 0, cfg.get("output_len")
    sizes = sorted(len(r.prompt) - shared + out / 2 for r in generate(cfg))
    room = args.workers * (args.num_blocks * SimConfig().block_size - shared)
    holds = room / (sum(sizes) / len(sizes))
    life_s = out * cost.decode_ms(max(1, round(holds / args.workers)), room // args.workers) / 1000.0
    smallest = sizes[: int(0.9 * len(sizes))]
    return {
        "room_tokens": room,
        "mean_footprint_tokens": sum(sizes) / len(sizes),
        "life_s": life_s,
        "serve_all_rps": room / (sum(sizes) / len(sizes) * life_s),
        "serve_smallest_90pct_rps": room / (sum(smallest) / len(sizes) * life_s),
    }


def attainment(job: tuple) -> float:
    policy, workload, rate, seed, blocks, profile, duration = job
    fleet = FleetConfig(
        workers=4,
        sim=SimConfig(num_blocks=blocks),
        cost=CostModel.load(profile),
        views_with_cost=True,
        slo_ttft_ms=2000.0,
        slo_tpot_ms=100.0,
    )
    wl = WorkloadConfig(name=workload, rate=rate, duration_s=duration, seed=seed)
    return summarize(FleetSim(load_policy(policy), fleet).run(generate(wl), duration), 2000.0, 100.0)["slo_attainment"]


def plot(report: dict, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (policy, by_pool) in enumerate(report["attainment"].items()):
        for pool, style in (("1x", "-"), ("2x", ":")):
            ax.plot(report["rates"], by_pool[pool], style, marker="o", color=f"C{i}", label=f"{policy} ({pool} pool)")
    for key, style in (("serve_all_rps", "--"), ("serve_smallest_90pct_rps", "-.")):
        ax.axvline(report["bounds"][key], color="grey", linestyle=style, label=key.replace("_", " "))
    ax.axhline(0.9, color="black", linewidth=0.5)
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment", title=f"{report['workload']}: pool-bound ceilings")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="multi-turn")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[16, 19, 22, 25])
    p.add_argument("--policies", default="slo_goodput,round_robin,bench.peer_policies:CacheAware")
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--profile", default="bench/profiles/h200-llama8b-kvgate-eager.json")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    policies = args.policies.split(",")
    jobs = [
        (pol, args.workload, r, s, blocks, args.profile, args.duration)
        for pol in policies
        for blocks in (args.num_blocks, 2 * args.num_blocks)
        for r in args.rates
        for s in range(args.seeds)
    ]
    with ProcessPoolExecutor(args.jobs) as ex:
        got = dict(zip(jobs, ex.map(attainment, jobs)))
    report = {
        "workload": args.workload,
        "rates": args.rates,
        "bounds": bounds(args, CostModel.load(args.profile)),
        "attainment": {
            pol: {
                pool: [
                    sum(got[(pol, args.workload, r, s, blocks, args.profile, args.duration)] for s in range(args.seeds))
                    / args.seeds
                    for r in args.rates
                ]
                for pool, blocks in (("1x", args.num_blocks), ("2x", 2 * args.num_blocks))
            }
            for pol in policies
        },
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report, str(Path(args.out).with_suffix(".png")))
    print(json.dumps(report["bounds"], indent=1))
    for pol, by_pool in report["attainment"].items():
        print(pol, {k: [round(a, 3) for a in v] for k, v in by_pool.items()})


if __name__ == "__main__":
    main()
