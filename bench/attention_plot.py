"""The attention benchmark's figure (bench/attention_kernels.py): its report as bars per point."""


def plot(report: dict, path: str) -> None:
    """Bars per point: decode time, decode bandwidth as a fraction of the copy's, prefill time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = ("triton", "gather_sdpa", "flex")
    panels = (
        ("decode", "decode: us per layer", "ms", 1000, True),
        ("decode", "decode: K/V GB/s / copy GB/s", "copy_fraction", 1, False),
        ("prefill", "prefill: us per layer", "ms", 1000, True),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(10, len(report["decode"]) * 0.7), 12))
    for ax, (kind, title, key, factor, log) in zip(axes, panels):
        entries = report[kind]
        labels = [
            f"{e['shape'].split('-')[-1]} b{e['batch']} c{e['context']}"
            if kind == "decode"
            else f"{e['shape'].split('-')[-1]} n{e['chunk']} p{e['prefix']}"
            for e in entries
        ]
        width = 0.8 / len(methods)
        for i, name in enumerate(methods):
            values = [e["methods"].get(name, {}).get(key, 0) * factor for e in entries]
            ax.bar([x + i * width for x in range(len(entries))], values, width, label=name)
        ax.set_xticks([x + width for x in range(len(entries))], labels, rotation=60, fontsize=7)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        else:
            ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"paged attention, {report['device']}, {report['dtype']}, page {report['page']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
