"""Is a fresh worker slow at a new load? Back-to-back runs of one workload against one worker,
with every step's wall time and the CUDA caching allocator's counters.

    python experiments/gpu_warmup.py --tokenizer-dir DIR --out bench/results/h200-warmup-mechanism.json

It builds a random-weight Llama-3-8B-shaped checkpoint (bench.random_model), serves it from a
`kvgate worker` in this process (so the allocator is readable) and drives it with `kvgate
bench serve` in a subprocess (so the client never holds the worker's GIL). The runs: 3 s at a
fifth of `--rate`, then `--runs` runs of `--duration` s at `--rate`, each with its own seed so
no run reuses another's questions; `--empty-cache-after K` empties the allocator's cache
after run K (the cold-start test of the allocator alone). Per run: TTFT/TPOT p50, mean step,
steps that called cudaMalloc and the time they took, reserved memory; per step: wall ms,
tokens, decode sequences, largest context, allocator counter deltas, reserved GiB. A PNG of
step time over each run is written next to the JSON.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from itertools import accumulate
from pathlib import Path

import httpx

from bench import random_model

COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
WORKLOAD = [
    "--workload",
    "shared-prefix",
    "--groups",
    "4",
    "--prefix-len",
    "1024",
    "--question-len",
    "128",
    "--output-len",
    "64",
    "--vocab-size",
    "49152",
]
LLAMA_8B = [
    "--layers",
    "32",
    "--hidden",
    "4096",
    "--intermediate",
    "14336",
    "--heads",
    "32",
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--vocab-size",
    "49152",
    "--max-len",
    "8192",
]


def allocator() -> dict:
    import torch

    s = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {k: s.get(k, 0) for k in COUNTERS} | {"reserved_gb": s.get("reserved_bytes.all.current", 0) / 2**30}


class StepLog:
    """Wraps the executor's `execute` to time every step and read the allocator around it."""

    def __init__(self, executor):
        self.steps: list[list] = []
        self.inner = executor.execute
        executor.execute = self.execute

    def execute(self, chunks):
        a, t = allocator(), time.perf_counter()
        out = self.inner(chunks)
        ms, b = (time.perf_counter() - t) * 1000, allocator()
        self.steps.append(
            [
                round(ms, 2),
                sum(len(c.token_ids) for c in chunks),
                sum(1 for c in chunks if len(c.token_ids) == 1),
                max((c.start_pos + len(c.token_ids) for c in chunks), default=0),
                *(b[k] - a[k] for k in COUNTERS),
                round(b["reserved_gb"], 2),
            ]
        )
        return out


def load_run(url: str, rate: float, duration: float, seed: int) -> dict:
    """One `kvgate bench serve` run of the workload, in a subprocess; its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "bench",
                "serve",
                "--url",
                url,
                *WORKLOAD,
                "--rate",
                str(rate),
                "--duration",
                str(duration),
                "--seed",
                str(seed),
                "--slo-tpot-ms",
                "100",
                "--label",
                "run",
                "--out",
                out,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        with open(out) as f:
            run = json.load(f)["policies"]["run"]["runs"][0]
    return {k: run[k] for k in ("requests", "errors", "ttft_p50_ms", "tpot_p50_ms", "throughput_tok_s")}


def serve(args, root: Path, port: int):
    """A worker for `root` on `port`, in this process; returns its server."""
    import uvicorn

    from workers.cli import build_server, parser

    server = build_server(
        parser().parse_args(
            ["--model", str(root), "--device", args.device, "--num-blocks", str(args.num_blocks), "--port", str(port)]
        )
    )
    threading.Thread(
        target=uvicorn.run,
        args=(server.app,),
        daemon=True,
        kwargs=dict(host="127.0.0.1", port=port, log_level="warning"),
    ).start()
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError("worker did not come up")


def measure(args) -> list[dict]:
    import torch

    root = Path(args.model_dir)
    if not (root / "config.json").exists():
        mp = argparse.ArgumentParser()
        random_model.add_args(mp)
        with torch.device(args.device):
            random_model.make_model(mp.parse_args(["--tokenizer-dir", args.tokenizer_dir, *args.shape]), root)
    if args.no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    server = serve(args, root, args.port)
    log = StepLog(server.engine.executor)
    url, runs = f"http://127.0.0.1:{args.port}", []
    plan = [("warm-up", args.rate / 5, 3.0, args.seed)] + [
        (f"run {i + 1}", args.rate, args.duration, args.seed + 1 + i) for i in range(args.runs)
    ]
    for i, (label, rate, duration, seed) in enumerate(plan):
        log.steps.clear()
        a, t = allocator(), time.time()
        summary = load_run(url, rate, duration, seed)
        b, steps = allocator(), list(log.steps)
        ms = [s[0] for s in steps]
        runs.append(
            {
                "label": label,
                "rate": rate,
                "seed": seed,
                "wall_s": round(time.time() - t, 1),
                **summary,
                "steps": len(ms),
                "mean_step_ms": sum(ms) / max(1, len(ms)),
                "alloc_delta": {k: b[k] - a[k] for k in COUNTERS},
                "reserved_gb_after": b["reserved_gb"],
                "steps_with_device_alloc": sum(1 for s in steps if s[4] > 0),
                "ms_in_steps_with_alloc": sum(s[0] for s in steps if s[4] > 0),
                "raw_steps": steps,
            }
        )
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "raw_steps"}), flush=True)
        if i == args.empty_cache_after:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return runs


def plot(runs: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for r in runs[1:]:
        ms = [s[0] for s in r["raw_steps"]]
        ax.plot(
            [t / 1000 for t in accumulate(ms)],
            ms,
            linewidth=0.8,
            label=f"{r['label']}: TPOT p50 {r['tpot_p50_ms']:.0f} ms, "
            f"{r['steps_with_device_alloc']} steps with cudaMalloc",
        )
    ax.set_yscale("log")
    ax.set_xlabel("time into the run (s)")
    ax.set_ylabel("step wall time (ms)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer-dir", help="tokenizer files for the random checkpoint")
    p.add_argument("--model-dir", default="/tmp/kvgate-llama8b-random")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--num-blocks", type=int, default=40000)
    p.add_argument("--port", type=int, default=18500)
    p.add_argument("--rate", type=float, default=25.0)
    p.add_argument("--duration", type=float, default=25.0)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--seed", type=int, default=10)
    p.add_argument("--empty-cache-after", type=int, help="empty the allocator's cache after run K (0: the warm-up)")
    p.add_argument("--no-cudnn", action="store_true", help="take cuDNN out of scaled_dot_product_attention")
    p.add_argument("--title", default="one worker, back-to-back runs")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG of an existing --out")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.shape = LLAMA_8B
    if not args.plot_only and not args.tokenizer_dir and not (Path(args.model_dir) / "config.json").exists():
        p.error("--tokenizer-dir is needed to build the checkpoint in --model-dir")
    if args.plot_only:
        saved = json.loads(Path(args.out).read_text())
        runs = saved["runs"] if isinstance(saved, dict) else saved
    else:
        runs = measure(args)
        Path(args.out).write_text(
            json.dumps({"command": "python experiments/gpu_warmup.py " + " ".join(argv or sys.argv[1:]), "runs": runs})
        )
    plot(runs, args.title, os.path.splitext(args.out)[0] + ".png")
    os._exit(0)  # the worker's threads do not stop on their own


if __name__ == "__main__":
    main()
