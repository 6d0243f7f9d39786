"""P/D KV transfer throughput between two real workers: HTTP bytes vs CUDA IPC vs NIXL.

Starts a prefill worker and a decode worker (random weights from a Llama config: transfer cost
depends on the KV shape, not on the weights), runs P/D requests of growing prompt length with
fresh prompts (so every block really moves), and reads the bytes and seconds the prefill
worker's exporter spent from its /state, and the time each worker's engine thread spent on the
transfer instead of stepping (`engine_calls_s`). JSON and PNG out.
"""

import argparse
import concurrent.futures as cf
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.random_model import add_args, make_model
from workers.internal_auth import internal_headers
from gateway.procs import Worker

TOKEN = "bench-token"


def leg(url: str, ids: list[int], max_tokens: int, kv: dict, headers: dict[str, str] | None = None) -> float:
    """Send one leg (with `headers` besides the internal token); returns seconds to its first
    streamed token."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    t0 = time.perf_counter()
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        timeout=600,
        headers={**internal_headers(TOKEN), **(headers or {})},
        json={
            "model": model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
            "kv_transfer": kv,
        },
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def measure(p: Worker, d: Worker, n: int, rng: random.Random, vocab: int) -> dict:
    ids = [rng.randrange(100, vocab) for _ in range(n)]
    p0, d0 = (httpx.get(w.url + "/state", headers=internal_headers(TOKEN)).json() for w in (p, d))
    before, recv0 = p0["kv_transfer"], d0["kv_transfer"]["received_seconds"]
    with cf.ThreadPoolExecutor(2) as pool:
        dec = pool.submit(leg, d.url, ids, 4, {"wait_ms": 60000})
        pool.submit(leg, p.url, ids, 1, {"export_to": d.url}).result()
        ttft = dec.result()
    time.sleep(0.2)  # the exporter releases its blocks on the engine thread after sending
    p1, d1 = (httpx.get(w.url + "/state", headers=internal_headers(TOKEN)).json() for w in (p, d))
    after, recv1 = p1["kv_transfer"], d1["kv_transfer"]["received_seconds"]
    nbytes = after["sent_bytes"] - before["sent_bytes"]
    secs = after["sent_seconds"] - before["sent_seconds"]
    return {
        "prompt_tokens": n,
        "bytes": nbytes,
        "seconds": secs,
        "gbps": nbytes / secs / 1e9 if secs else None,
        "pd_ttft_s": ttft,
        "failures": after["failures"],
        "receiver_seconds": {k: recv1[k] - recv0[k] for k in recv1},
        "engine_thread_s": {
            "prefill": p1["engine_calls_s"] - p0["engine_calls_s"],
            "decode": d1["engine_calls_s"] - d0["engine_calls_s"],
        },
    }


def run_transport(args, model: Path, transport: str, batch_blocks: int = 16) -> list[dict]:
    extra = [
        "--num-blocks",
        str(args.num_blocks),
        "--internal-token",
        TOKEN,
        "--kv-transport",
        transport,
        "--max-batched-tokens",
        str(args.max_batched_tokens),
    ]
    p = Worker(
        "torch",
        f"p-{transport}",
        extra=extra + ["--role", "prefill", "--device", args.devices[0], "--kv-export-batch-blocks", str(batch_blocks)],
        model=str(model),
    )
    d = Worker(
        "torch", f"d-{transport}", extra=extra + ["--role", "decode", "--device", args.devices[1]], model=str(model)
    )
    rng = random.Random(0)
    rows = []
    try:
        p.ready(300), d.ready(300)
        measure(p, d, 256, rng, args.vocab_size)
        for n in args.lengths:
            for _ in range(args.repeats):
                rows.append(
                    {
                        "transport": transport,
                        "export_batch_blocks": batch_blocks,
                        **measure(p, d, n, rng, args.vocab_size),
                    }
                )
                print(
                    f"{transport} {n} tokens: {rows[-1]['gbps']} GB/s, receiver {rows[-1]['receiver_seconds']}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        p.stop(), d.stop()
    return rows


def plot(rows: list[dict], path: Path, metric: str = "gbps") -> None:
    """`metric` per payload size, one series per transport (and export batch size, when the rows
    have several): every repeat as a dot, the best (highest GB/s, lowest TTFT) as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = {r.get("export_batch_blocks") for r in rows}

    def series(r: dict) -> str:
        k = r.get("export_batch_blocks")
        return (
            r["transport"]
            if len(batches) < 2
            else f"{r['transport']}, " + (f"batches of >= {k} blocks" if k else "all at prefill end")
        )

    pick = max if metric == "gbps" else min
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in sorted({series(r) for r in rows}):
        pts = [(r["bytes"] / 2**20, r[metric]) for r in rows if series(r) == name and r[metric]]
        best = {x: pick(y for x2, y in pts if x2 == x) for x, _ in pts}
        (line,) = ax.plot(*zip(*sorted(best.items())), "-", label=f"{name} (best of repeats)")
        ax.plot(*zip(*pts), "o", color=line.get_color(), alpha=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("KV payload (MiB)")
    ax.set_ylabel({"gbps": "GB/s", "pd_ttft_s": "P/D time to first token (s)"}[metric])
    ax.legend()
    ax.set_title("P/D KV transfer throughput" if metric == "gbps" else "P/D TTFT")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    p.add_argument("--devices", default="cuda:0,cuda:1", type=lambda s: s.split(","))
    p.add_argument("--transports", default="http,ipc", type=lambda s: s.split(","))
    p.add_argument("--lengths", default="1024,4096,16384", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--export-batch-blocks",
        default="16",
        type=lambda s: [int(x) for x in s.split(",")],
        help="the prefill worker's --kv-export-batch-blocks, one run each (0: ship at prefill end); "
        "with several, the plot shows P/D TTFT, the figure pipelining changes",
    )
    p.add_argument("--out", default="bench/results/transfer_throughput.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(args, Path(tmp))
        rows = [r for t in args.transports for k in args.export_batch_blocks for r in run_transport(args, model, t, k)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.transfer_throughput " + " ".join(argv or sys.argv[1:]),
                "config": {k: v for k, v in vars(args).items()},
                "runs": rows,
            },
            indent=1,
        )
    )
    plot(rows, out.with_suffix(".png"), "pd_ttft_s" if len(args.export_batch_blocks) > 1 else "gbps")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
