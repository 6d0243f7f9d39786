"""PNG plots of a report: latency CDFs per policy at the compared rate, and SLO attainment
against request rate with each policy's goodput. Drawn from the report dict alone, so a
saved JSON can be re-plotted."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

METRICS = (("ttft", "TTFT (ms)", "slo_ttft_ms"), ("tpot", "TPOT (ms)", "slo_tpot_ms"),
           ("e2e", "end-to-end (ms)", None), ("itl", "inter-token latency (ms)", "slo_tpot_ms"))


def _run_at(entry: dict, rate: float) -> dict:
    return min(entry["runs"], key=lambda r: abs(r["rate_rps"] - rate))


def plot_cdfs(report: dict, path: str) -> None:
    """One panel per latency metric, one CDF line per policy, SLOs dashed."""
    rate = report["reference_rate_rps"]
    runs = {label: _run_at(e, rate) for label, e in report["policies"].items()}
    shown = [m for m in METRICS if any(r.get("cdf", {}).get(m[0]) for r in runs.values())]
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
    fig.suptitle(f"{report.get('title', '')} at {rate:.4g} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_attainment(report: dict, path: str) -> None:
    """Attainment vs rate per policy with the 90% line, next to a goodput bar per policy."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    names = list(report["policies"])
    for name in names:
        runs = report["policies"][name]["runs"]
        ax.plot([r["rate_rps"] for r in runs], [r["slo_attainment"] for r in runs], marker="o", label=name)
    ax.axhline(report["target_attainment"], color="k", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (TTFT and TPOT)")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    good = [report["policies"][n]["goodput_rps"] for n in names]
    bx.bar(range(len(names)), good, color=[f"C{i}" for i in range(len(names))])
    bx.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    bx.set_ylabel("goodput (req/s at 90% attainment)")
    for i, g in enumerate(good):
        bx.text(i, g, f"{g:.3g}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(report.get("title", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_report(report: dict, json_path: str) -> list[str]:
    """Both plots next to the JSON: X.json -> X-cdf.png, X-attainment.png."""
    stem = json_path[:-5] if json_path.endswith(".json") else json_path
    paths = [f"{stem}-cdf.png", f"{stem}-attainment.png"]
    plot_cdfs(report, paths[0])
    plot_attainment(report, paths[1])
    return paths
