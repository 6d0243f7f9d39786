"""SLO attainment of one policy on issue 16's simulated fleet, averaged over seeds, per workload
and rate: the grid behind bench/results/README.md's "slo_goodput's ledger" tables.

The fleet is tests/test_simulate_pressure's (4 workers, the H200 Llama-8B eager profile, 1024
KV blocks each, views with the cost model, TTFT / TPOT SLOs 2000 / 100 ms); the policy gets the
SLOs and any `--policy-arg` JSON. `--replicas N` puts N instances of it behind a balancer
(`Replicas`: `--split`, `--share`). Writes JSON and a PNG of attainment against rate.

    PYTHONPATH=. python experiments/sim_grid.py --policy slo_goodput --policy-arg '{"ledger_wait": false}' \\
        --out /tmp/sim-grid.json
"""

import argparse
import json
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.fleet_sim import FleetConfig, FleetSim
from bench.report import summarize
from bench.sim_worker import SimConfig
from bench.workloads import WorkloadConfig, generate
from policies.api import FleetView, Observer, Policy, RequestView, Route, Tallied
from policies.registry import load_policy
from workers.kv.cost_model import CostModel

RATES = {"multi-turn": "18,20,21,22", "shared-prefix": "44,48,52,56", "skewed": "21,23,25"}
PROFILE = "bench/profiles/h200-llama8b-kvgate-eager.json"


def balancer(split: str, n: int) -> Callable[[int, int], int]:
    """Which of `n` gateway replicas the `i`th request, of `tokens` prompt tokens, goes to:
    "turns", each to the next; "size:T", prompts over T tokens to the first replica and the
    rest to the others in turn (a balancer that sorts traffic)."""
    if split == "turns":
        return lambda i, tokens: i % n
    if not split.startswith("size:"):
        raise ValueError(f"a split is 'turns' or 'size:T', not {split!r}")
    long = int(split.removeprefix("size:"))
    if n == 1:
        return lambda i, tokens: 0
    return lambda i, tokens: 0 if tokens > long else 1 + i % (n - 1)


class Replicas:
    """Gateway replicas behind a load balancer (`balancer`), each with its own instance of the
    policy; the fleet's in-flight counts and ledgers reach every one at once
    (`gateway.shared_ledger`). `share`: what each decision tells the other replicas, as Redis
    carries it in a gateway: "none", "routed" (where the prompt went, `policies.api.Observer`)
    or "all" (that and the decision's tally, `policies.api.Tallied`), heard at once (a pub/sub
    message takes about a millisecond, the windows span seconds)."""

    def __init__(self, policies: list[Policy], split: str = "turns", share: str = "none") -> None:
        self.policies, self.name, self.seen = policies, policies[0].name, 0
        self.pick = balancer(split, len(policies))
        self.share = share

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        i = self.pick(self.seen, req.num_tokens)
        self.seen += 1
        route = self.policies[i].route(req, fleet)
        others = [p for j, p in enumerate(self.policies) if j != i]
        if self.share in ("routed", "all") and route.worker is not None:
            sent = next(w for w in fleet.workers if w.worker_id == (route.prefill or route.worker))
            for p in others:
                if isinstance(p, Observer):
                    p.observe(req, sent, fleet.now)
        if self.share == "all" and route.tally is not None:
            for p in others:
                if isinstance(p, Tallied):
                    p.add_tally(route.tally, fleet.now)
        return route


def attainment(job: tuple[str, dict, str, float, int, float, int, str, str]) -> float:
    policy, kwargs, workload, rate, seed, duration, replicas, split, share = job
    fleet = FleetConfig(
        workers=4,
        sim=SimConfig(num_blocks=1024),
        cost=CostModel.load(PROFILE),
        views_with_cost=True,
        slo_ttft_ms=2000.0,
        slo_tpot_ms=100.0,
    )
    sim = FleetSim(
        Replicas([load_policy(policy, ttft_ms=2000.0, tpot_ms=100.0, **kwargs) for _ in range(replicas)], split, share),
        fleet,
    )
    wl = WorkloadConfig(name=workload, rate=rate, duration_s=duration, seed=seed)
    return summarize(sim.run(generate(wl), duration), 2000.0, 100.0)["slo_attainment"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="slo_goodput")
    p.add_argument("--policy-arg", default="{}", help="constructor arguments as a JSON object")
    p.add_argument("--workloads", default="multi-turn,shared-prefix,skewed")
    p.add_argument("--rates", default="", help="R1,R2,... for every workload (default: each its own)")
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--replicas", type=int, default=1, help="policy instances behind a balancer (`Replicas`)")
    p.add_argument("--split", default="turns", help="turns, or size:T (prompts over T tokens to the first replica)")
    p.add_argument("--share", choices=("none", "routed", "all"), default="none", help="what replicas tell each other")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    kwargs = json.loads(args.policy_arg)
    grid = {w: [float(r) for r in (args.rates or RATES[w]).split(",")] for w in args.workloads.split(",")}
    jobs = [
        (args.policy, kwargs, w, r, s, args.duration, args.replicas, args.split, args.share)
        for w, rates in grid.items()
        for r in rates
        for s in range(args.seeds)
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(attainment, jobs))
    table: dict[str, dict[str, float]] = {}
    for (_, _, w, r, *_), a in zip(jobs, results):
        table.setdefault(w, {}).setdefault(f"{r:g}", 0.0)
        table[w][f"{r:g}"] += a / args.seeds
    report = {
        "policy": args.policy,
        "policy_arg": kwargs,
        "seeds": args.seeds,
        "replicas": args.replicas,
        "split": args.split,
        "share": args.share,
        "duration_s": args.duration,
        "attainment": table,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    fig, axes = plt.subplots(1, len(table), figsize=(4.2 * len(table), 3.6), squeeze=False)
    for ax, (w, by_rate) in zip(axes[0], table.items()):
        ax.plot([float(r) for r in by_rate], list(by_rate.values()), marker="o", label=args.policy)
        ax.axhline(0.9, color="black", linewidth=0.5)
        ax.set(title=w, xlabel="request rate (req/s)", ylabel="SLO attainment")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(args.out).with_suffix(".png"), dpi=110)
    for w, by_rate in table.items():
        print(w, "  ".join(f"{r}: {a:.3f}" for r, a in by_rate.items()))


if __name__ == "__main__":
    main()
