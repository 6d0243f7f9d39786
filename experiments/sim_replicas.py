"""slo_goodput behind two gateway replicas in the simulator, with and without their decisions'
tallies shared (`policies.api.Tallied`), under a balancer that spreads requests in turn and one
that sorts them (long prompts to one replica, the rest to the other), against one router.
SLO attainment per rate, averaged over seeds, on experiments/sim_grid.py's fleet. Writes JSON
and a PNG of attainment against rate.

    PYTHONPATH=. python experiments/sim_replicas.py --workload mixed --rates 20,24,28,32,40,60,100 \\
        --out bench/results/sim-replicas-mixed.json
"""

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from experiments.sim_grid import attainment

# (label, replicas, balancer, what the replicas share)
CONFIGS = (
    ("one router", 1, "turns", "none"),
    ("2 replicas, in turn, routed only", 2, "turns", "routed"),
    ("2 replicas, in turn, routed + tallies", 2, "turns", "all"),
    ("2 replicas, sorted by size, routed only", 2, "size:{long}", "routed"),
    ("2 replicas, sorted by size, routed + tallies", 2, "size:{long}", "all"),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="mixed")
    p.add_argument("--rates", default="20,24,28,32,40,60,100")
    p.add_argument(
        "--long", type=int, default=1024, help="the sorting balancer's bound: prompts over it go to replica 0"
    )
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    configs = [(label, n, split.format(long=a.long), share) for label, n, split, share in CONFIGS]
    jobs = [
        ("slo_goodput", {}, a.workload, r, s, a.duration, n, split, share)
        for _, n, split, share in configs
        for r in rates
        for s in range(a.seeds)
    ]
    with ProcessPoolExecutor(a.jobs) as pool:
        results = iter(list(pool.map(attainment, jobs)))
    table = {
        label: {f"{r:g}": sum(next(results) for _ in range(a.seeds)) / a.seeds for r in rates} for label, *_ in configs
    }
    report = {
        "workload": a.workload,
        "long_tokens": a.long,
        "seeds": a.seeds,
        "duration_s": a.duration,
        "configs": [dict(zip(("label", "replicas", "split", "share"), c)) for c in configs],
        "attainment": table,
        "good_rps": {label: {r: v * float(r) for r, v in by_rate.items()} for label, by_rate in table.items()},
    }
    Path(a.out).write_text(json.dumps(report, indent=1))
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for label, by_rate in table.items():
        ax.plot(
            rates, list(by_rate.values()), marker="o", label=label, linestyle="--" if "routed only" in label else "-"
        )
    ax.axhline(0.9, color="black", linewidth=0.5)
    ax.set(title=f"slo_goodput behind replicas, simulated ({a.workload})", xlabel="request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(a.out).with_suffix(".png"), dpi=110)
    for label, by_rate in table.items():
        print(f"{label:46s}", "  ".join(f"{r}: {v:.3f}" for r, v in by_rate.items()))


if __name__ == "__main__":
    main()
