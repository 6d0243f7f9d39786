"""Offline engine throughput on the nano-vllm workload.

256 sequences, input and output lengths uniform in [100, 1024], random token ids, EOS
ignored, seed 0 — scalable down by flags for a CPU. Drives the engine directly (no HTTP),
so the figure is the engine's: scheduler + KV manager + executor. On CUDA it also measures the
device's copy bandwidth and matmul rate and reports the run against the roofline of the steps
it took (bench/roofline.py); `--hf-generate` times HF `generate` on the same prompts (equal
lengths only: a static batch) for a naive baseline.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

from workers.config import EngineConfig
from workers.engine import Engine
from workers.model_store import load_tokenizer, resolve, served_name
from workers.sampling_params import SamplingParams
from workers.startup_heap import settle_gc
from workers.step_stats import StepRecord, StepStats


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=0, help="0: enough for every sequence at once")
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-kernels", action="store_true", help="the gather + SDPA path even on CUDA")
    p.add_argument("--hf-generate", action="store_true", help="also time HF generate on the same prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup-seqs",
        type=int,
        default=64,
        help="sequences of the same shape run untimed first, as nano-vllm's bench warms up (0: none)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs of the workload in this process (cache cleared between); the median one is reported",
    )
    p.add_argument("--out", default="bench/results/engine_throughput.json")
    return p


def workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [
        (
            [rng.randint(0, 10000) for _ in range(rng.randint(args.min_input_len, args.max_input_len))],
            rng.randint(args.min_output_len, args.max_output_len),
        )
        for _ in range(args.num_seqs)
    ]


def build_engine(args, seqs) -> Engine:
    import torch

    from workers.executors.torch_runner import TorchRunner

    need = sum(-(-(len(p) + n) // args.block_size) for p, n in seqs)
    blocks = args.num_blocks or need
    dtype = getattr(torch, args.dtype) if args.dtype else None
    runner = TorchRunner(
        str(resolve(args.model)),
        blocks,
        args.block_size,
        args.device,
        dtype,
        kernels=False if args.no_kernels else None,
        enforce_eager=args.enforce_eager,
        max_num_seqs=min(args.max_num_seqs, args.num_seqs),
    )
    cfg = EngineConfig(
        served_name(args.model), args.block_size, blocks, args.max_batched_tokens, args.max_num_seqs, worker_id="bench"
    )
    return Engine(runner, load_tokenizer(args.model), cfg)


def run(engine: Engine, seqs) -> dict:
    started = time.time()
    timeline: list[tuple[float, int]] = []
    done = [0]
    for i, (prompt, n) in enumerate(seqs):
        engine.submit(
            f"s{i}",
            prompt,
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
            lambda out: done.__setitem__(0, done[0] + (out.finish_reason is not None)),
            detokenize=False,
        )
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        timeline.append((time.perf_counter() - t0, engine.stats.generated_tokens))
        if engine.stats.steps % 20 == 0:
            print(
                f"\r{done[0]}/{len(seqs)} done, {engine.stats.generated_tokens} tokens, {timeline[-1][0]:.0f}s",
                end="",
                file=sys.stderr,
                flush=True,
            )
    elapsed = time.perf_counter() - t0
    print(file=sys.stderr)
    out_tokens = sum(n for _, n in seqs)
    in_tokens = sum(len(p) for p, _ in seqs)
    return {
        "started_unix": started,
        "seconds": elapsed,
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (in_tokens + out_tokens) / elapsed,
        "steps": engine.stats.steps,
        "preemptions": engine.stats.preemptions,
        "timeline": timeline,
        "step_log": list(engine.stats.recent),
    }


def step_split(log: list[StepRecord]) -> dict:
    """Where a step's time goes, decode-only and other steps apart: the executor's share (inputs,
    forward, sampling) and the engine's around it (scheduling, commits, outputs)."""
    out = {}
    for kind, steps in (
        ("decode", [s for s in log if s.work.prefill_tokens == 0]),
        ("prefill_or_mixed", [s for s in log if s.work.prefill_tokens]),
    ):
        if steps:
            out[kind] = {
                "steps": len(steps),
                "executor_ms_mean": sum(s.ms for s in steps) / len(steps),
                "wall_ms_mean": sum(s.wall_ms for s in steps) / len(steps),
                "seconds": sum(s.wall_ms for s in steps) / 1000,
            }
    return out


def device_split(runner) -> dict:
    """The CUDA steps' device time split where their inputs were complete (TorchRunner.timings):
    decode graph replays and other steps apart, so a run slowed by the host waiting shows as
    `waited_ms`, and one slowed on the device as `computed_ms`."""
    out = {}
    for kind, rows in (
        ("replays", [t for t in runner.timings if t.replayed]),
        ("other", [t for t in runner.timings if not t.replayed]),
    ):
        if rows:
            computed = sorted(t.computed_ms for t in rows)
            out[kind] = {
                "steps": len(rows),
                "waited_ms_mean": sum(t.waited_ms for t in rows) / len(rows),
                "computed_ms_mean": sum(computed) / len(rows),
                "computed_ms_sorted_deciles": [computed[min(len(rows) - 1, len(rows) * k // 10)] for k in range(11)],
            }
    return out


def timed_runs(args, engine: Engine, seqs) -> dict:
    """`args.repeats` timed runs; the median run (by tok/s) with every run's summary beside it."""
    runs = []
    for _ in range(args.repeats):
        engine.stats = StepStats()
        engine.pool.clear_cache()
        timings = getattr(engine.executor, "timings", None)
        if timings is not None:
            timings.clear()
        result = run(engine, seqs)
        if timings is not None:
            result["device_split"] = device_split(engine.executor)
        runs.append(result)
        split = result.get("device_split", {}).get("replays", {})
        print(
            f"run {len(runs)}: {result['output_tok_s']:.0f} output tok/s in {result['seconds']:.2f} s"
            + (
                f"; replays waited {split['waited_ms_mean']:.3f} + computed {split['computed_ms_mean']:.3f} ms"
                if split
                else ""
            ),
            file=sys.stderr,
        )
    median = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]
    if len(runs) > 1:
        median["runs"] = [
            {k: r[k] for k in ("started_unix", "seconds", "output_tok_s", "device_split") if k in r} for r in runs
        ]
    return median


def roofline(engine: Engine, result: dict) -> dict:
    """The run's steps priced at the device's measured ceilings: bound time, tok/s, fraction."""
    import torch

    from bench.roofline import measure, model_cost

    runner = engine.executor
    ceilings = measure(runner.device, runner.dtype)
    cost = model_cost(runner)
    bound = sum(
        cost.step_bound_s(
            s.work.prefill_tokens, s.work.decode_seqs, s.work.decode_kv_tokens, s.work.prefill_ctx_products, ceilings
        )
        for s in result["step_log"]
    )
    if len(result["step_log"]) < result["steps"]:
        raise RuntimeError("the step log dropped steps; raise workers.engine.STEP_LOG")
    torch.cuda.empty_cache()
    return {
        "ceilings": ceilings.to_json(),
        "bound_s": bound,
        "roofline_output_tok_s": result["output_tokens"] / bound,
        "roofline_fraction": bound / result["seconds"],
        "weight_bytes": cost.weight_bytes,
        "kv_bytes_per_token": cost.kv_bytes_per_token,
    }


def hf_generate(args, seqs) -> dict:
    """HF `generate` (sdpa, static batch, greedy, exactly n new tokens) on the same prompts."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    if len({len(p) for p, _ in seqs}) != 1 or len({n for _, n in seqs}) != 1:
        raise SystemExit("--hf-generate needs equal prompt and output lengths (--min-input-len = --max-input-len ...)")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16
    model = (
        AutoModelForCausalLM.from_pretrained(str(resolve(args.model)), dtype=dtype, attn_implementation="sdpa")
        .to(args.device)
        .eval()
    )
    ids = torch.tensor([p for p, _ in seqs], device=args.device)
    n = seqs[0][1]
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    with torch.inference_mode():
        model.generate(
            ids[:2], **{**kw, "attention_mask": kw["attention_mask"][:2], "max_new_tokens": 4, "min_new_tokens": 4}
        )
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        sync()
    elapsed = time.perf_counter() - t0
    if out.shape[1] != ids.shape[1] + n:
        raise RuntimeError(f"HF generate made {out.shape[1] - ids.shape[1]} tokens, not {n}")
    return {"seconds": elapsed, "output_tok_s": len(seqs) * n / elapsed}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, tok = zip(*result["timeline"]) if result["timeline"] else ((), ())
    runs = result.get("runs", [])
    fig, axes = plt.subplots(1, 2 if runs else 1, figsize=(12 if runs else 7, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(t, tok)
    ax.set_xlabel("seconds")
    ax.set_ylabel("output tokens generated")
    ax.set_title(
        f"{result['config']['model']} on {result['config']['device']}: {result['output_tok_s']:.1f} output tok/s"
    )
    if runs:
        plot_runs(axes[0][1], runs)
    fig.tight_layout()
    fig.savefig(path)


def plot_runs(ax, runs: list[dict]) -> None:
    """Each timed run's tok/s, with its decode replays' device time split (waited / computed)."""
    xs = range(1, len(runs) + 1)
    ax.bar(xs, [r["output_tok_s"] for r in runs], color="tab:blue", label="output tok/s")
    ax.set_xlabel("run")
    ax.set_ylabel("output tok/s")
    split = [r.get("device_split", {}).get("replays") for r in runs]
    if all(split):
        ms = ax.twinx()
        ms.plot(xs, [s["waited_ms_mean"] for s in split], "o-", color="tab:red", label="replay waited ms")
        ms.plot(xs, [s["computed_ms_mean"] for s in split], "s-", color="tab:green", label="replay computed ms")
        ms.set_ylabel("ms per decode replay")
        ms.set_ylim(bottom=0)
        ms.legend(loc="lower right")
    ax.set_title("timed runs in one process")


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    seqs = workload(args)
    engine = build_engine(args, seqs)
    if args.warmup_seqs:
        warm = argparse.Namespace(**{**vars(args), "num_seqs": args.warmup_seqs, "seed": args.seed + 1})
        run(engine, [(p, min(n, 64)) for p, n in workload(warm)])
    settle_gc()
    result = timed_runs(args, engine, seqs)
    runner = engine.executor
    result["path"] = {"kernels": runner.kernels, "cuda_graphs": runner.graphs is not None}
    if runner.graphs is not None:
        result["path"].update(capture_s=runner.graphs.capture_s, graph_mib=runner.graphs.memory_bytes / 2**20)
    if runner.device.type == "cuda":
        result["roofline"] = roofline(engine, result)
    if args.hf_generate:
        del engine, runner
        result["hf_generate"] = hf_generate(args, seqs)
    result["steps_split"] = step_split(result.pop("step_log"))
    result["config"] = vars(args)
    result["command"] = "python -m bench.engine_throughput " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(result, out.with_suffix(".png"))
    result["timeline"] = result["timeline"][:: max(1, len(result["timeline"]) // 200)]
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("timeline", "config")}, indent=1))
    if "roofline" in result:
        r = result["roofline"]
        print(
            f"{result['output_tok_s']:.0f} output tok/s = {100 * r['roofline_fraction']:.1f}% of the roofline's "
            f"{r['roofline_output_tok_s']:.0f} ({r['ceilings']['copy_gbps']:.0f} GB/s copy, "
            f"{r['ceilings']['matmul_tflops']:.0f} TFLOP/s matmul)"
        )


if __name__ == "__main__":
    main()
