"""Goodput with and without the host KV tier, from pairs of `kvgate simulate` reports (the same
fleet and workload, one with --host-kv-blocks): per workload and policy, goodput and the cached
token ratio at the goodput rate. JSON and PNG out; the inputs stay beside them."""

import argparse
import json
import sys
from pathlib import Path

from bench.report import read_json


def compare(pairs: dict[str, tuple[dict, dict]]) -> dict:
    """{workload: {policy: {device_*, host_*}}} from (device only, with host tier) reports."""
    out: dict[str, dict] = {}
    for workload, (dev, host) in pairs.items():
        rows = {}
        for policy, d in dev["policies"].items():
            h = host["policies"].get(policy)
            if h is None:
                continue
            rows[policy] = {
                "device_goodput_rps": d["goodput_rps"],
                "host_goodput_rps": h["goodput_rps"],
                "device_cached_token_ratio": d["cached_token_ratio"],
                "host_cached_token_ratio": h["cached_token_ratio"],
                "goodput_gain": h["goodput_rps"] / d["goodput_rps"] if d["goodput_rps"] else None,
            }
        out[workload] = {"commands": [dev["command"], host["command"]], "policies": rows}
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report["workloads"])
    cols = min(3, len(workloads))
    rows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(workloads) :]:
        ax.set_axis_off()
    for ax, workload in zip(axes.flat, workloads):
        rows = report["workloads"][workload]["policies"]
        names = list(rows)
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [rows[n]["device_goodput_rps"] for n in names], 0.4, label="device only")
        ax.bar([i + 0.2 for i in x], [rows[n]["host_goodput_rps"] for n in names], 0.4, label="+ host tier")
        for i, n in enumerate(names):
            ax.text(
                i + 0.2,
                rows[n]["host_goodput_rps"],
                f"hit {rows[n]['host_cached_token_ratio']:.2f}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
            ax.text(
                i - 0.2,
                rows[n]["device_goodput_rps"],
                f"hit {rows[n]['device_cached_token_ratio']:.2f}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_xticks(list(x), names)
        ax.set(title=workload, ylabel="goodput (req/s at 90% SLO attainment)")
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(report["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pair", nargs=3, action="append", required=True, metavar=("WORKLOAD", "DEVICE_JSON", "HOST_JSON"))
    p.add_argument("--title", default="host KV tier: simulated goodput")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    pairs = {w: (read_json(d), read_json(h)) for w, d, h in args.pair}
    report = {
        "kind": "tier_compare",
        "title": args.title,
        "command": "python -m bench.tier_compare " + " ".join(argv or sys.argv[1:]),
        "inputs": {w: [d, h] for w, d, h in args.pair},
        "workloads": compare(pairs),
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report, str(Path(args.out).with_suffix(".png")))
    for workload, entry in report["workloads"].items():
        for policy, r in entry["policies"].items():
            print(
                f"{workload:14s} {policy:16s} goodput {r['device_goodput_rps']:7.1f} -> {r['host_goodput_rps']:7.1f} "
                f"req/s, hit ratio {r['device_cached_token_ratio']:.2f} -> {r['host_cached_token_ratio']:.2f}"
            )


if __name__ == "__main__":
    main()
