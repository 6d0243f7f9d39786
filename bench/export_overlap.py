"""Does block-batch export overlap the prefill on real workers? Export in batches against
export after the prefill, over NIXL, read from the prefill worker's own traces.

Starts a decode worker and one prefill worker per `--export-batch-blocks` value (torch CPU
executor, random weights: the timing depends on the KV shape, not the weights), all with
`--kv-transport nixl`, the prefill workers tracing to their console. For a long prompt it sends
the P/D legs as the gateway does (the decode leg waits for the blocks), with a trace id of its
own on the prefill leg, then reads that trace's spans from the prefill worker's log: one
`prefill_chunk` per prefill step and one `kv_export` per batch (from the hand-over to the end
of its transfer). Reported per run: whether the first export began before the last chunk
ended (the overlap), how long after the prefill the last export ended (the transfer time left
exposed), and the decode leg's time to first token. JSON and PNG out.
"""

import argparse
import concurrent.futures as cf
import json
import os
import random
import secrets
import sys
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import httpx

from bench.random_model import add_args, make_model
from bench.transfer_throughput import TOKEN, leg
from gateway.procs import Worker, stop_all, wait_for
from workers.internal_auth import internal_headers

SPAN_FLUSH_MS = "100"  # the workers' span batches leave this often, so a run's spans show at once


@dataclass(frozen=True)
class Timeline:
    """One request's prefill chunks and KV exports, (start, end) in seconds from its first
    chunk's start, in order."""

    chunks: list[tuple[float, float]]
    exports: list[tuple[float, float]]

    @property
    def prefill_end(self) -> float:
        return max(end for _, end in self.chunks)

    @property
    def overlaps(self) -> bool:
        """The first batch's export began before the last prefill chunk completed."""
        return self.exports[0][0] < self.prefill_end

    @property
    def exposed_s(self) -> float:
        """How long after the prefill the last export ended: the transfer not hidden by it."""
        return max(end for _, end in self.exports) - self.prefill_end


def console_spans(text: str) -> list[dict]:
    """The spans an OpenTelemetry console exporter wrote into a log (JSON objects, one per span,
    between other log lines)."""
    decoder, spans, i = json.JSONDecoder(), [], text.find('{\n    "name"')
    while i >= 0:
        span, end = decoder.raw_decode(text, i)
        spans.append(span)
        i = text.find('{\n    "name"', end)
    return spans


def timeline(spans: list[dict], trace_id: str) -> Timeline:
    """The chunks and exports of the trace `trace_id` (32 hex digits)."""

    def at(stamp: str) -> float:
        return datetime.fromisoformat(stamp).timestamp()

    mine = [s for s in spans if s["context"]["trace_id"] == "0x" + trace_id]
    by_name = {
        name: sorted((at(s["start_time"]), at(s["end_time"])) for s in mine if s["name"] == name)
        for name in ("prefill_chunk", "kv_export")
    }
    t0 = by_name["prefill_chunk"][0][0] if by_name["prefill_chunk"] else 0.0
    chunks, exports = ([(a - t0, b - t0) for a, b in by_name[n]] for n in ("prefill_chunk", "kv_export"))
    return Timeline(chunks, exports)


def exported_blocks(spans: list[dict], trace_id: str) -> int:
    return sum(
        s["attributes"]["kvgate.blocks"]
        for s in spans
        if s["name"] == "kv_export" and s["context"]["trace_id"] == "0x" + trace_id
    )


def traced_leg(p: Worker, d: Worker, ids: list[int]) -> tuple[Timeline, float]:
    """Both P/D legs of a prompt; the prefill leg under a fresh trace id. Returns the prefill
    worker's timeline of it, once every exported block's span is in its log, and the decode
    leg's TTFT. `p` traces to its console, flushing often (SPAN_FLUSH_MS)."""
    trace_id = secrets.token_hex(16)
    before = p.state()["kv_transfer"]
    blocks0 = exported_total(p)
    traced = {**internal_headers(p.token), "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    with cf.ThreadPoolExecutor(2) as pool:
        decode = pool.submit(leg, d.url, ids, 2, {"wait_ms": 60000}, internal_headers(d.token))
        pool.submit(leg, p.url, ids, 1, {"export_to": d.url}, traced).result()
        ttft = decode.result()
    wait_for(lambda: p.state()["kv_transfer"]["backlog_bytes"] == 0, timeout=120, what="the exports sent")
    blocks = exported_total(p) - blocks0
    spans = wait_for(
        lambda: (s := console_spans(p.log_path.read_text())) and exported_blocks(s, trace_id) == blocks and s,
        timeout=60,
        what="the exports' spans",
    )
    after = p.state()["kv_transfer"]
    if after["nixl"]["fallbacks"] != before["nixl"]["fallbacks"]:
        raise RuntimeError("an export fell back to HTTP: this run did not measure NIXL")
    return timeline(spans, trace_id), ttft


def exported_total(w: Worker) -> int:
    """Blocks the worker handed to its exporters so far."""
    text = httpx.get(w.url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("kvgate_worker_kv_exported_blocks_total{"))
    return int(float(line.rsplit(" ", 1)[1]))


def start(args, model: Path, logs: str) -> tuple[Worker, dict[int, Worker]]:
    common = ["--internal-token", TOKEN, "--kv-transport", "nixl", "--num-blocks", str(args.num_blocks)]
    common += ["--max-batched-tokens", str(args.max_batched_tokens)]
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = SPAN_FLUSH_MS
    d = Worker("torch", "d", extra=[*common, "--role", "decode"], model=str(model), log_dir=logs)
    prefill = {
        k: Worker(
            "torch",
            f"p-batch{k}",
            extra=[*common, "--role", "prefill", "--kv-export-batch-blocks", str(k), "--trace", "console"],
            model=str(model),
            log_dir=logs,
        )
        for k in args.export_batch_blocks
    }
    return d, prefill


def measure(args, model: Path, logs: str) -> list[dict]:
    d, prefill = start(args, model, logs)
    rng = random.Random(0)
    rows = []
    try:
        for w in (d, *prefill.values()):
            w.ready(300)
        for k, p in prefill.items():
            traced_leg(p, d, [rng.randrange(100, args.vocab_size) for _ in range(256)])  # warm-up
            for repeat in range(args.repeats):
                tl, ttft = traced_leg(p, d, [rng.randrange(100, args.vocab_size) for _ in range(args.tokens)])
                rows.append(
                    {
                        "export_batch_blocks": k,
                        "repeat": repeat,
                        "prompt_tokens": args.tokens,
                        "overlaps": tl.overlaps,
                        "first_export_start_s": tl.exports[0][0],
                        "prefill_end_s": tl.prefill_end,
                        "exposed_s": tl.exposed_s,
                        "pd_ttft_s": ttft,
                        "timeline": asdict(tl),
                    }
                )
                print(
                    f"batch {k}: overlaps {tl.overlaps}, exposed {tl.exposed_s:.3f} s, TTFT {ttft:.3f} s",
                    file=sys.stderr,
                )
    finally:
        stop_all([d, *prefill.values()])
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Each run's timeline: prefill chunks above, exports below, the prefill's end marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.3 * len(rows) + 1), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        tl = r["timeline"]
        ax.broken_barh([(a, b - a) for a, b in tl["chunks"]], (1.1, 0.8), facecolors="tab:blue", edgecolor="white")
        for i, (a, b) in enumerate(tl["exports"]):
            ax.broken_barh([(a, b - a)], (0.1 + 0.8 * (i % 2) / 2, 0.4), facecolors="tab:orange", edgecolor="white")
        ax.axvline(r["prefill_end_s"], color="k", lw=0.8, ls="--")
        k = r["export_batch_blocks"]
        mode = f"batches of >= {k} blocks" if k else "all after the prefill"
        ax.set_title(f"{mode}: exposed {r['exposed_s']:.2f} s, P/D TTFT {r['pd_ttft_s']:.2f} s", fontsize=9)
        ax.set_yticks([0.5, 1.5], ["exports", "prefill chunks"])
    axes[-1, 0].set_xlabel("seconds from the first prefill chunk (dashed: prefill end)")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    p.set_defaults(layers=16, hidden=256, intermediate=512, heads=8, kv_heads=4, head_dim=128)
    p.add_argument("--tokens", type=int, default=2048, help="the long prompt's length")
    p.add_argument("--max-batched-tokens", type=int, default=256, help="the prefill step")
    p.add_argument("--export-batch-blocks", default="0,16", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--out", default="bench/results/export_overlap_cpu.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args, make_model(args, Path(tmp) / "model"), tmp)
    out = Path(args.out)
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.export_overlap " + " ".join(argv or sys.argv[1:]),
                "config": vars(args),
                "runs": rows,
            },
            indent=1,
        )
    )
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
