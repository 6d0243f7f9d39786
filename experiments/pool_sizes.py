"""How the KV pool's size moves each policy's goodput on a workload (issue 16 point 7's fleet).

Issue 16 asks slo_goodput for 1.3x the best peer on multi-turn chat, with pools too small for
the working set; on the comparison's 1024-block pools the pools bind (`pool_bound.py`). This
runs `kvgate simulate --sweep` once per pool size, in virtual time (seconds per size), and
reports every policy's goodput and its ratio to a baseline policy (round robin: the peers'
goodput sits at its on this workload), to tell whether another pool size would let routing,
not the pool, decide the comparison.

    PYTHONPATH=. python experiments/pool_sizes.py --sizes 768,1024,1536,2048 \\
        --out bench/results/sim-multi-turn-pool-sizes.json
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def goodputs(size: int, args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    """Each policy's goodput (req/s) from one `kvgate simulate --sweep` of pools of `size` blocks."""
    out = scratch / f"sim-{size}.json"
    cmd = [sys.executable, "-m", "gateway.cli", "simulate", "--workers", str(args.workers)]
    cmd += ["--workload", args.workload, "--num-blocks", str(size), "--profile", args.profile]
    cmd += ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
    cmd += ["--duration", str(args.duration), "--sweep", "--refine", str(args.refine), "--views-with-cost"]
    cmd += ["--policies", args.policies, "--jobs", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    return {name: p["goodput_rps"] for name, p in report["policies"].items()}


def plot(sizes: list[int], table: dict[int, dict[str, float]], baseline: str, path: Path) -> None:
    """Goodput against pool size, and each policy's ratio to `baseline`."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in table[sizes[0]]:
        left.plot(sizes, [table[s][name] for s in sizes], marker="o", label=name)
        if name != baseline:
            right.plot(sizes, [table[s][name] / table[s][baseline] for s in sizes], marker="o", label=name)
    right.axhline(1.3, color="grey", linestyle="--", label="1.3x")
    left.set(xlabel="KV blocks per worker", ylabel="goodput (req/s)", title="goodput by pool size")
    right.set(xlabel="KV blocks per worker", ylabel=f"goodput / {baseline}'s", title=f"ratio to {baseline}")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="768,1024,1536,2048", help="KV blocks per worker, comma-separated")
    p.add_argument("--workload", default="multi-turn")
    p.add_argument("--policies", default="slo_goodput,round_robin,prefix_affinity")
    p.add_argument("--baseline", default="round_robin", help="the policy ratios are taken to")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--profile", default="bench/profiles/h200-llama8b-kvgate-eager.json")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    p.add_argument("--refine", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        table = {size: goodputs(size, args, Path(tmp)) for size in sizes}
    out = Path(args.out)
    ratios = {s: {n: g / table[s][args.baseline] for n, g in table[s].items()} for s in sizes}
    report = {"kind": "pool-sizes", "command": " ".join(sys.argv), "config": vars(args)}
    report |= {"goodput_rps": table, "ratio_to_baseline": ratios}
    out.write_text(json.dumps(report, indent=1))
    plot(sizes, table, args.baseline, out.with_suffix(".png"))
    for s in sizes:
        print(s, {n: f"{g:.1f} ({ratios[s][n]:.2f}x)" for n, g in table[s].items()})


if __name__ == "__main__":
    main()
