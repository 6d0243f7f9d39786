"""PNG plots of a report: latency CDFs per policy at the compared rate, and SLO attainment
against request rate with each policy's goodput. Drawn from the report dict alone, so a
saved JSON can be re-plotted."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


METRICS = (
    ("ttft", "TTFT (ms)", "slo_ttft_ms"),
    ("tpot", "TPOT (ms)", "slo_tpot_ms"),
    ("e2e", "end-to-end (ms)", None),
    ("itl", "inter-token latency (ms)", "slo_tpot_ms"),
)


def _run_at(entry: dict, rate: float) -> dict:
    return min(entry["runs"], key=lambda r: abs(r["rate_rps"] - rate))


def _failures(report: dict) -> str:
    """'a: 12 of 12 requests failed (http 503: 12)' per entry with failures at the compared rate."""
    lines = [
        f"{name}: {e['errors']} of {_run_at(e, report['reference_rate_rps'])['requests']} requests failed "
        f"({', '.join(f'{k}: {n}' for k, n in (e.get('error_kinds') or {}).items())})"
        for name, e in report["policies"].items()
        if e.get("errors")
    ]
    return "\n".join(lines)


def plot_cdfs(report: dict, path: str) -> None:
    """One panel per latency metric, one CDF line per policy, SLOs dashed; when no request
    succeeded, one panel that says so."""
    rate = report["reference_rate_rps"]
    runs = {label: _run_at(e, rate) for label, e in report["policies"].items()}
    shown = [m for m in METRICS if any(r.get("cdf", {}).get(m[0]) for r in runs.values())]
    if not shown:
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.text(
            0.5,
            0.5,
            "no request succeeded: no latencies to plot\n" + _failures(report),
            ha="center",
            va="center",
            wrap=True,
            fontsize=9,
        )
        ax.set_axis_off()
        fig.suptitle(f"{report.get('title', '')} at {rate:.4g} req/s")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False)
    for ax, (key, label, slo) in zip(axes[0], shown):
        for name, run in runs.items():
            q = run.get("cdf", {}).get(key)
            if q:
                ax.plot(q, np.linspace(0, 1, len(q)), label=name)
        if slo and report.get(slo):
            ax.axvline(report[slo], color="k", linestyle="--", linewidth=1, label="SLO")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    failures = _failures(report)
    fig.suptitle(
        f"{report.get('title', '')} at {rate:.4g} req/s" + (f"\nfailed, not plotted: {failures}" if failures else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_attainment(report: dict, path: str) -> None:
    """Attainment vs rate per policy with the 90% line, next to a bar per policy: its goodput
    from a sweep, or its attainment when it ran at one rate (which measures no goodput)."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    names = list(report["policies"])
    one_rate = all(e.get("goodput_method") == "single_rate" for e in report["policies"].values())
    for name in names:
        runs = report["policies"][name]["runs"]
        ax.plot([r["rate_rps"] for r in runs], [r["slo_attainment"] for r in runs], marker="o", label=name)
        for r in runs:
            if r.get("errors"):
                ax.annotate(
                    f"{r['errors']} failed",
                    (r["rate_rps"], r["slo_attainment"]),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(4, 4),
                    color="C3",
                )
    ax.axhline(report["target_attainment"], color="k", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (TTFT and TPOT)")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    rate = report["reference_rate_rps"]
    key, what = (
        ("slo_attainment", f"SLO attainment at {rate:.4g} req/s (one rate: no goodput)")
        if one_rate
        else ("goodput_rps", "goodput (req/s at 90% attainment)")
    )
    bars = [report["policies"][n][key] or 0.0 for n in names]
    bx.bar(range(len(names)), bars, color=[f"C{i}" for i in range(len(names))])
    bx.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    bx.set_ylabel(what, fontsize=9)
    for i, g in enumerate(bars):
        bx.text(i, g, f"{g:.3g}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(report.get("title", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_paths(json_path: str) -> list[str]:
    """Where `plot_report` draws: X.json -> X-cdf.png, X-attainment.png."""
    stem = json_path[:-5] if json_path.endswith(".json") else json_path
    return [f"{stem}-cdf.png", f"{stem}-attainment.png"]


def plot_report(report: dict, json_path: str) -> list[str]:
    """Both plots next to the JSON (`plot_paths`)."""
    paths = plot_paths(json_path)
    plot_cdfs(report, paths[0])
    plot_attainment(report, paths[1])
    return paths
