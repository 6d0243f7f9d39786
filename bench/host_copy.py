"""Host KV tier: copy-out and copy-back rates of the torch executor, against prefill of the same
blocks, on one device.

For each batch of n blocks: `swap_out` (device -> host slots) and `swap_in` (host -> device
blocks) as the engine issues them, timed to completion (CUDA: synchronised), and a prefill of
the n blocks' tokens in one step. `host_credit` = 1 - copy-back ms / prefill ms per block: what
a host hit would save were its copy to hold the step. The engine runs the copy beside the steps
instead, so the router credits a host block whole and charges the copy time (the rate measured
here: gateway --host-kv-gbps) to its own request's TTFT. JSON and PNG out.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from workers.executors.batch import SeqChunk
from workers.executors.torch_runner import TorchRunner
from workers.model_store import resolve
from workers.sampling_params import SamplingParams


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median ms of `fn()` over `repeat` runs, each run to completion."""
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def measure(runner: TorchRunner, n: int, repeat: int, rng: random.Random) -> dict:
    B = runner.block_size
    ids = rng.sample(range(runner.num_blocks), n)
    slots = list(range(n))
    block_bytes = B * runner.kv_bytes_per_token
    out_ms = timed(lambda: runner.swap_out(ids, slots), runner.device, repeat)
    in_ms = timed(lambda: runner.swap_in(ids, slots), runner.device, repeat)
    tokens = [rng.randrange(100, runner.vocab_size) for _ in range(n * B)]
    chunk = SeqChunk(tokens, 0, list(range(n)), True, SamplingParams(temperature=0.0))
    prefill_ms = timed(lambda: runner.execute([chunk]), runner.device, repeat)
    return {
        "blocks": n,
        "bytes": n * block_bytes,
        "swap_out_ms": out_ms,
        "swap_in_ms": in_ms,
        "swap_out_gbps": n * block_bytes / out_ms / 1e6,
        "swap_in_gbps": n * block_bytes / in_ms / 1e6,
        "prefill_ms": prefill_ms,
        "host_credit": max(0.0, 1.0 - in_ms / prefill_ms),
    }


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    n = [r["blocks"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(n, [r["swap_out_gbps"] for r in rows], "o-", label="device -> host (swap_out)")
    a.plot(n, [r["swap_in_gbps"] for r in rows], "o-", label="host -> device (swap_in)")
    a.set(xscale="log", xlabel="blocks per batch", ylabel="GB/s", title="copy rate")
    a.legend()
    b.plot(n, [r["swap_in_ms"] / r["blocks"] for r in rows], "o-", label="copy back, ms/block")
    b.plot(n, [r["prefill_ms"] / r["blocks"] for r in rows], "o-", label="prefill, ms/block")
    b.set(
        xscale="log",
        yscale="log",
        xlabel="blocks per batch",
        ylabel="ms per block",
        title=f"host credit {report['host_credit']:.3f} (1 - copy/prefill)",
    )
    b.legend()
    fig.suptitle(report["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="HF folder or alias")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", default="1,4,16,64", help="batch sizes in blocks")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", required=True, help="report JSON; the PNG is written next to it")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.blocks.split(",")]
    runner = TorchRunner(str(resolve(args.model)), max(sizes), args.block_size, args.device)
    runner.allocate_host_cache(max(sizes))
    rng = random.Random(0)
    measure(runner, sizes[0], 1, rng)  # first-call costs (allocations, kernels) out of the figures
    rows = [measure(runner, n, args.repeat, rng) for n in sizes]
    largest = rows[-1]
    report = {
        "kind": "host_copy",
        "command": "python -m bench.host_copy " + " ".join(argv or sys.argv[1:]),
        "title": f"host KV tier on {runner.device} ({torch.get_num_threads()} threads): {args.model}, "
        f"{runner.dtype}, {args.block_size}-token blocks of {args.block_size * runner.kv_bytes_per_token} B",
        "device": str(runner.device),
        "model": args.model,
        "dtype": str(runner.dtype),
        "block_size": args.block_size,
        "kv_bytes_per_token": runner.kv_bytes_per_token,
        "host_credit": largest["host_credit"],
        "swap_in_gbps": largest["swap_in_gbps"],
        "swap_out_gbps": largest["swap_out_gbps"],
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report, str(Path(args.out).with_suffix(".png")))
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
