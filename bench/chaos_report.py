"""What a chaos run reports (`bench.chaos`): the summary of its judged outcomes, the gateway's
RSS growth, a one-line headline per scenario, and the PNG timeline."""

from collections import Counter

import numpy as np

from bench import chaos_client as cc


def summary(outcomes: list[cc.Outcome], span_s: float) -> dict:
    ok = [o for o in outcomes if o.result == cc.OK]
    lat = np.array([o.latency_ms for o in ok]) if ok else np.zeros(0)
    ttft = np.array([o.ttft_ms for o in ok if o.ttft_ms is not None])

    def pct(a: np.ndarray, p: float) -> float | None:
        return float(np.percentile(a, p)) if a.size else None

    dirt = sorted({o.detail for o in outcomes if o.result in (cc.DIRTY, cc.LOST)})[:10]
    errors = Counter(
        o.detail.split(" retry-after")[0].split(" after ")[0] for o in outcomes if o.result in (cc.REFUSED, cc.CLEAN)
    )
    return {
        "requests": len(outcomes),
        **cc.counts(outcomes),
        "span_s": span_s,
        "uncommitted_errors": sum(cc.uncommitted(o) for o in outcomes),
        "ok_per_s": len(ok) / span_s if span_s else 0.0,
        "admitted_latency_p50_ms": pct(lat, 50),
        "admitted_latency_p99_ms": pct(lat, 99),
        "admitted_ttft_p50_ms": pct(ttft, 50),
        "admitted_ttft_p99_ms": pct(ttft, 99),
        "dirty_examples": dirt,
        "error_codes": dict(errors),
        "per_second": cc.per_second(outcomes, span_s),
    }


def rss_growth(samples: list[tuple[float, float]], span_s: float) -> dict:
    """The gateway's RSS once warm (after a fifth of the run) against its last sample."""
    warm = [mb for t, mb in samples if t >= span_s / 5]
    if len(warm) < 2:
        return {"rss_warm_mb": None, "rss_end_mb": None, "rss_growth_mb": None}
    return {"rss_warm_mb": warm[0], "rss_end_mb": warm[-1], "rss_growth_mb": warm[-1] - warm[0]}


def headline(run: dict) -> str:
    keys = (
        "requests",
        *cc.OUTCOMES,
        "leaked_blocks",
        "rss_growth_mb",
        "admitted_latency_p50_ms",
        "admitted_latency_p99_ms",
        "capacity_rps",
        "max_s",
    )
    parts = [f"{k}={run[k]:.4g}" if isinstance(run.get(k), float) else f"{k}={run[k]}" for k in keys if k in run]
    for name, sub in run.items():
        if isinstance(sub, dict) and name != "per_second" and name != "error_codes":
            parts.append(f"[{name}: {headline(sub)}]")
    return ", ".join(parts)


def plot(report: dict, path: str) -> None:
    """One timeline panel per run: outcomes per second, kills and restarts marked; gateway RSS
    (soak, redis) or the deepest worker queue (overload) on the right axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, run) for name, run in report["scenarios"].items() if "per_second" in run]
    for variant in ("admission", "unbounded"):
        if variant in report["scenarios"].get("overload", {}):
            panels.append(
                (
                    f"overload x{report['scenarios']['overload']['factor']:g}, {variant}",
                    report["scenarios"]["overload"][variant],
                )
            )
    liveness = report["scenarios"].get("liveness")
    rows = len(panels) + (liveness is not None)
    fig, axes = plt.subplots(rows, 1, figsize=(11, 3.2 * rows), squeeze=False)
    if liveness is not None:
        ax = axes[-1, 0]
        for i, r in enumerate(liveness.values()):
            if isinstance(r, dict):
                ax.scatter([i] * len(r["seconds"]), r["seconds"], color="tab:blue")
        names = [k for k, v in liveness.items() if isinstance(v, dict)]
        ax.set_xticks(range(len(names)), names)
        ax.axhline(2.0, color="k", linestyle="--", linewidth=1)
        ax.set_ylabel("seconds to out of service")
        ax.set_title("liveness: fault to the gateway taking the worker out (dashed: 2 s)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    colors = {cc.OK: "tab:green", cc.REFUSED: "tab:orange", cc.CLEAN: "tab:blue", cc.DIRTY: "tab:red", cc.LOST: "black"}
    for ax, (name, run) in zip(axes[:, 0], panels):
        for k, series in run["per_second"].items():
            if any(series):
                ax.plot(range(len(series)), series, label=f"{k} ({sum(series)})", color=colors[k])
        for t, kind, _ in run.get("events", ()):
            ax.axvline(
                t, color="red" if kind == "kill" else "green", linestyle="-" if kind == "kill" else ":", linewidth=1
            )
        ax.set_ylabel("requests / s")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
        right = run.get("rss_mb") or run.get("worker_waiting")
        if right:
            twin = ax.twinx()
            twin.plot([t for t, _ in right], [v for _, v in right], color="gray", linewidth=1)
            twin.set_ylabel("gateway RSS (MB)" if run.get("rss_mb") else "max worker queue")
            twin.set_ylim(0, 1.15 * max(v for _, v in right) + 1)
    if panels:
        axes[len(panels) - 1, 0].set_xlabel("seconds (red: SIGKILL, green dotted: restarted)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
