"""One table of the KV tiers' goodput: per setting (workload, fleet size, simulated or real),
each tier configuration's goodput (req/s at >= 90% SLO attainment) and cached token ratio, read
from `kvgate simulate` and `bench.real_fleet` reports of one policy. JSON (with every input's
command) and a PNG of grouped bars out.

    python -m bench.tiers_goodput --policy slo_goodput \\
        --row "shared-prefix, 8 sim" device bench/results/sim-tiers-shared-prefix-8w-device.json \\
        --row "shared-prefix, 8 sim" host bench/results/sim-tiers-shared-prefix-8w-host.json \\
        --out bench/results/tiers-goodput.json
"""

import argparse
import json
import sys
import textwrap
from pathlib import Path

from bench.report import read_json


def entry(report: dict, policy: str) -> tuple[str, dict]:
    """The report's result for `policy`, or its only one (a real fleet's is named by the fleet)."""
    results = report["policies"]
    if policy in results:
        return policy, results[policy]
    if len(results) == 1:
        return next(iter(results.items()))
    raise SystemExit(f"{report.get('command', '?')}: no result for {policy} among {sorted(results)}")


def table(rows: list[tuple[str, str, str]], policy: str) -> dict:
    """{setting: {variant: {goodput_rps, cached_token_ratio, ..., input, command}}}, in row order."""
    out: dict[str, dict] = {}
    for setting, variant, path in rows:
        report = read_json(path)
        name, r = entry(report, policy)
        out.setdefault(setting, {})[variant] = {
            "goodput_rps": r["goodput_rps"],
            "cached_token_ratio": r["cached_token_ratio"],
            "slo_attainment": r["slo_attainment"],
            "at_rate_rps": r["at_rate_rps"],
            "policy": name,
            "input": path,
            "command": report["command"],
        }
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(report["settings"])
    colour = {v: f"C{i}" for i, v in enumerate(dict.fromkeys(v for s in settings for v in report["settings"][s]))}
    cols = min(4, len(settings))
    rows = -(-len(settings) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(settings) :]:
        ax.set_axis_off()
    for ax, setting in zip(axes.flat, settings):
        variants = report["settings"][setting]
        names = list(variants)
        goodput = [variants[n]["goodput_rps"] for n in names]
        ax.bar(range(len(names)), goodput, color=[colour[n] for n in names])
        for i, n in enumerate(names):
            ax.text(i, goodput[i], f"hit {variants[n]['cached_token_ratio']:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(setting, fontsize=9)
    for ax in axes[:, 0]:
        ax.set_ylabel("goodput (req/s at 90% SLO attainment)")
    fig.suptitle("\n".join(textwrap.wrap(report["title"], 40 * cols)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", nargs=3, action="append", required=True, metavar=("SETTING", "VARIANT", "JSON"))
    p.add_argument("--policy", default="slo_goodput", help="the policy whose results are read")
    p.add_argument("--title", default="KV tiers: goodput and cached token ratio")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    report = {
        "kind": "tiers_goodput",
        "title": args.title,
        "command": "python -m bench.tiers_goodput " + " ".join(json.dumps(a) for a in (argv or sys.argv[1:])),
        "settings": table([tuple(r) for r in args.row], args.policy),
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report, str(Path(args.out).with_suffix(".png")))
    for setting, variants in report["settings"].items():
        for variant, r in variants.items():
            print(f"{setting:28s} {variant:22s} {r['goodput_rps']:8.1f} req/s  hit {r['cached_token_ratio']:.2f}")


if __name__ == "__main__":
    main()
