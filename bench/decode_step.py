"""Time one decode step of the torch runner: n sequences at a given context, per path.

Paths: `graphs` (Triton kernels + CUDA graph replay, the CUDA default), `eager` (kernels, no
graphs), `gather` (the reference gather + SDPA path). For each batch size the sequences are
prefilled to `--context` tokens, then `--steps` decode steps are timed as the engine sees them
(`execute`: inputs, forward, sampling, one host sync), with the host-side input preparation and
the roofline bound (weights + K/V read at the measured copy bandwidth) beside them.
"""

import argparse
import json
import statistics
import sys
import time
from array import array
from pathlib import Path

from workers.executors.batch import SeqChunk
from workers.executors.kernel_inputs import decode_inputs
from workers.model_store import resolve
from workers.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder (bench/random_model.py makes one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,8,64,256", help="decode batch sizes")
    p.add_argument("--context", type=int, default=600, help="tokens of context per sequence")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size")
    p.add_argument("--paths", default="graphs,eager,gather", help="which runner paths to time")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="also profile this batch size's steps (torch.profiler): the GPU kernels by time",
    )
    p.add_argument("--out", required=True)
    return p


def make_runner(args, path: str, max_seqs: int):
    from workers.executors.torch_runner import TorchRunner

    blocks = max_seqs * -(-(args.context + 2 * args.steps + 8) // args.block_size) + 1
    return TorchRunner(
        str(resolve(args.model)),
        blocks,
        args.block_size,
        args.device,
        kernels=path != "gather",
        enforce_eager=path != "graphs",
        max_num_seqs=max_seqs,
    )


def time_batch(runner, n: int, args, profile: bool = False) -> dict:
    """Prefill n sequences to the context, then time decode steps over them (and, with
    `profile`, profile five more: each GPU kernel's time per step)."""
    import random

    rng = random.Random(args.seed)
    b = args.block_size
    per_seq = -(-(args.context + 2 * args.steps + 8) // b)
    # int32 arrays, as the engine hands a request's table (Request.block_ids)
    tables = [array("i", range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(n)]
    prompts = [[rng.randrange(1000) for _ in range(args.context)] for _ in range(n)]
    chunk = max(1, 8192 // args.context)
    last: list[int] = []
    for lo in range(0, n, chunk):
        rows = range(lo, min(n, lo + chunk))
        last += runner.execute([SeqChunk(prompts[i], 0, tables[i], True, GREEDY) for i in rows])
    pos = [args.context] * n
    walls, preps = [], []
    for step in range(args.steps + 3):
        chunks = [SeqChunk([last[i]], pos[i], tables[i], True, GREEDY, step) for i in range(n)]
        t0 = time.perf_counter()
        decode_inputs(chunks, b)
        t1 = time.perf_counter()
        last = runner.execute(chunks)
        t2 = time.perf_counter()
        pos = [p + 1 for p in pos]
        if step >= 3:
            preps.append((t1 - t0) * 1000)
            walls.append((t2 - t1) * 1000)
    row = {
        "batch": n,
        "context": args.context,
        "step_ms_median": statistics.median(walls),
        "step_ms_min": min(walls),
        "step_ms_max": max(walls),
        "prep_ms_median": statistics.median(preps),
    }
    if runner.overlaps:
        row["overlapped_step_ms_median"] = overlapped(runner, tables, pos, args)
    if profile:
        row["kernels"] = profile_steps(
            runner, [SeqChunk([last[i]], pos[i], tables[i], True, GREEDY, 0) for i in range(n)], 5
        )
    return row


def overlapped(runner, tables: list[array], pos: list[int], args) -> float:
    """Median ms between step completions when each step is launched before the previous one's
    tokens are read (as the engine runs on CUDA): input tokens filled on the device."""
    from workers.inflight import PLACEHOLDER

    n = len(tables)
    pending = runner.launch([SeqChunk([0], pos[i], tables[i], True, GREEDY, 0) for i in range(n)])
    gaps, last = [], time.perf_counter()
    for step in range(1, args.steps + 3):
        chunks = [
            SeqChunk([PLACEHOLDER], pos[i] + step, tables[i], True, GREEDY, step, prev_sample=i) for i in range(n)
        ]
        nxt = runner.launch(chunks)
        runner.collect(pending)
        pending, now = nxt, time.perf_counter()
        if step > 3:
            gaps.append((now - last) * 1000)
        last = now
    runner.collect(pending)
    return statistics.median(gaps)


def profile_steps(runner, chunks: list[SeqChunk], steps: int) -> list[dict]:
    """GPU time per step of each kernel name over `steps` repeats of one step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.execute(chunks)
    rows = [
        {"name": e.key[:120], "ms_per_step": e.device_time_total / 1000 / steps, "calls_per_step": e.count / steps}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows[:25]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    batches = sorted({r["batch"] for rows in result["paths"].values() for r in rows})
    series = []
    for name, rows in result["paths"].items():
        series.append((name, {r["batch"]: r["step_ms_median"] for r in rows}))
        if any("overlapped_step_ms_median" in r for r in rows):
            series.append((f"{name}, overlapped", {r["batch"]: r["overlapped_step_ms_median"] for r in rows}))
    series.append(("roofline", {r["batch"]: r["bound_ms"] for rows in result["paths"].values() for r in rows}))
    width = 0.8 / len(series)
    for k, (name, by) in enumerate(series):
        ax.bar(
            [i + k * width for i in range(len(batches))],
            [by.get(x, 0) for x in batches],
            width,
            label=name,
            color="grey" if name == "roofline" else None,
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))], [str(x) for x in batches])
    ax.set_xlabel(f"decode batch (sequences at {result['config']['context']} tokens of context)")
    ax.set_ylabel("ms per decode step (median)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"decode step: {Path(result['config']['model']).name} on {result['device_name']}")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    import gc

    import torch

    from bench.roofline import measure, model_cost

    args = parser().parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    result = {
        "config": vars(args),
        "paths": {},
        "command": "python -m bench.decode_step " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    device = torch.device(args.device)
    result["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    ceilings = measure(device) if device.type == "cuda" else None
    result["ceilings"] = ceilings.to_json() if ceilings else None
    for path in args.paths.split(","):
        runner = make_runner(args, path, max(batches))
        cost = model_cost(runner)
        rows = []
        for n in batches:
            row = time_batch(runner, n, args, profile=n == args.profile)
            if ceilings:
                row["bound_ms"] = 1000 * cost.step_bound_s(0, n, n * (args.context + 1), 0, ceilings)
            rows.append(row)
            print(
                f"{path:7} batch {n:4}: {row['step_ms_median']:.2f} ms/step (prep {row['prep_ms_median']:.2f} ms)"
                + (
                    f", overlapped {row['overlapped_step_ms_median']:.2f} ms"
                    if "overlapped_step_ms_median" in row
                    else ""
                ),
                file=sys.stderr,
                flush=True,
            )
            for k in row.get("kernels", [])[:12]:
                print(f"    {k['ms_per_step']:.3f} ms x{k['calls_per_step']:.0f} {k['name']}", file=sys.stderr)
        if runner.graphs is not None:
            result.setdefault("capture", {})[path] = {
                "seconds": runner.graphs.capture_s,
                "mib": runner.graphs.memory_bytes / 2**20,
            }
        result["paths"][path] = rows
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if ceilings:
        plot(result, out.with_suffix(".png"))
    print(
        json.dumps(
            {p: [{k: v for k, v in r.items() if k != "kernels"} for r in rows] for p, rows in result["paths"].items()},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
