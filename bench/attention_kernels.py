"""Paged attention on the GPU: our Triton kernels, today's gather + SDPA path, FlexAttention.

Decode (batch 1/8/64/256 at context 600/2k/8k) and prefill (a 512- or 2048-token chunk over a
0- or 2k-token cached prefix) at the Llama-3.2-1B attention shape (32 q heads, 8 kv heads,
head dim 64) and the Llama-3-8B one (head dim 128), bf16, 16-token pages, shuffled block tables.
Each point is timed as CUDA-graph replays (no launch overhead) over enough separate per-layer
caches that K/V come from HBM, not L2; decode bandwidth is K/V bytes read over the time, against
the copy bandwidth measured here (bytes read + written by a large device-to-device copy).
Every point also records the largest difference between the Triton and gather outputs.

    python -m bench.attention_kernels --out bench/results/h200-attention-kernels.json [--sweep]
    python -m bench.attention_kernels --dry-run --out /tmp/attn.json   # CPU: interpreter, tiny shapes
"""

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict

import torch

from bench.attention_measure import Timer, copy_bandwidth, decode_point, prefill_point, sweep
from bench.attention_plan import DRY_PLAN, GPU_PLAN, PAGE, Plan, release
from bench.attention_plot import plot


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON path; the PNG goes beside it")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes, fp32")
    p.add_argument("--sweep", action="store_true", help="also time a few tile configs at one point each")
    p.add_argument(
        "--flex",
        choices=("some", "all", "none"),
        default="some",
        help="FlexAttention at the plan's few points (each compiles), all points, or none",
    )
    return p


def run(plan: Plan, dev: torch.device, flex_mode: str, with_sweep: bool) -> dict:
    timer = Timer(dev.type == "cuda", plan.rep_ms)
    import torch._dynamo

    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, 64)  # --flex all compiles once per point
    start = time.perf_counter()
    report: dict = {
        "device": torch.cuda.get_device_name(dev) if timer.cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": str(plan.dtype).removeprefix("torch."),
        "page": PAGE,
        "shapes": [asdict(s) for s in plan.shapes],
        "decode": [],
        "prefill": [],
    }
    report["copy_bandwidth_gbps"] = copy_bandwidth(dev, timer, (2 << 30) if timer.cuda else (64 << 20))
    for shape in plan.shapes:
        for batch in plan.batches:
            for context in plan.contexts:
                chosen = flex_mode == "all" or (
                    flex_mode == "some" and (shape.name, batch, context) in plan.flex_decode
                )
                report["decode"].append(decode_point(shape, batch, context, plan, dev, timer, chosen))
                release(dev)
        for chunk in plan.chunks:
            for prefix in plan.prefixes:
                chosen = flex_mode == "all" or (
                    flex_mode == "some" and (shape.name, chunk, prefix) in plan.flex_prefill
                )
                report["prefill"].append(prefill_point(shape, chunk, prefix, plan, dev, timer, chosen))
                release(dev)
    for entry in report["decode"]:
        for m in entry["methods"].values():
            if "gbps" in m:
                m["copy_fraction"] = m["gbps"] / report["copy_bandwidth_gbps"]
    if with_sweep:
        report["sweep"] = sweep(plan, dev, timer)
    import triton

    report["triton"] = triton.__version__
    report["wall_s"] = time.perf_counter() - start
    return report


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.dry_run:
        from workers.kernels.interpreter import enable

        enable()  # before anything imports triton
        plan, dev = DRY_PLAN, torch.device("cpu")
    else:
        plan, dev = GPU_PLAN, torch.device("cuda")
    with torch.inference_mode():
        report = run(plan, dev, args.flex, args.sweep)
    report["command"] = "python -m bench.attention_kernels " + " ".join(sys.argv[1:] if argv is None else argv)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, args.out.removesuffix(".json") + ".png")
    print(json.dumps({k: report[k] for k in ("device", "copy_bandwidth_gbps", "wall_s")}))


if __name__ == "__main__":
    main()
