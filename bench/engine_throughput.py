"""Offline engine throughput on the nano-vllm workload.

256 sequences, input and output lengths uniform in [100, 1024], random token ids, EOS
ignored, seed 0 — scalable down by flags for a CPU. Drives the engine directly (no HTTP),
so the figure is the engine's: scheduler + KV manager + executor.
"""
import argparse
import json
import random
import sys
import time
from pathlib import Path

from workers.engine import Engine, EngineConfig
from workers.model_store import load_tokenizer, resolve, served_name
from workers.sampling_params import SamplingParams


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/engine_throughput.json")
    return p


def workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [([rng.randint(0, 10000) for _ in range(rng.randint(args.min_input_len, args.max_input_len))],
             rng.randint(args.min_output_len, args.max_output_len)) for _ in range(args.num_seqs)]


def build_engine(args, seqs) -> Engine:
    import torch

    from workers.executors.torch_runner import TorchRunner
    need = sum(-(-(len(p) + n) // args.block_size) for p, n in seqs)
    blocks = args.num_blocks or need
    dtype = getattr(torch, args.dtype) if args.dtype else None
    runner = TorchRunner(str(resolve(args.model)), blocks, args.block_size, args.device, dtype)
    cfg = EngineConfig(served_name(args.model), args.block_size, blocks, args.max_batched_tokens,
                       args.max_num_seqs, worker_id="bench")
    return Engine(runner, load_tokenizer(args.model), cfg)


def run(engine: Engine, seqs) -> dict:
    timeline: list[tuple[float, int]] = []
    done = [0]
    for i, (prompt, n) in enumerate(seqs):
        engine.submit(f"s{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                      lambda out: done.__setitem__(0, done[0] + (out.finish_reason is not None)),
                      detokenize=False)
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        timeline.append((time.perf_counter() - t0, engine.stats.generated_tokens))
        if engine.stats.steps % 20 == 0:
            print(f"\r{done[0]}/{len(seqs)} done, {engine.stats.generated_tokens} tokens, "
                  f"{timeline[-1][0]:.0f}s", end="", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t0
    print(file=sys.stderr)
    out_tokens = sum(n for _, n in seqs)
    in_tokens = sum(len(p) for p, _ in seqs)
    return {"seconds": elapsed, "output_tokens": out_tokens, "input_tokens": in_tokens,
            "output_tok_s": out_tokens / elapsed, "total_tok_s": (in_tokens + out_tokens) / elapsed,
            "steps": engine.stats.steps, "preemptions": engine.stats.preemptions, "timeline": timeline}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t, tok = zip(*result["timeline"]) if result["timeline"] else ((), ())
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(t, tok)
    ax.set_xlabel("seconds")
    ax.set_ylabel("output tokens generated")
    ax.set_title(f"{result['config']['model']} on {result['config']['device']}: "
                 f"{result['output_tok_s']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    seqs = workload(args)
    engine = build_engine(args, seqs)
    result = run(engine, seqs)
    result["config"] = vars(args)
    result["command"] = "python -m bench.engine_throughput " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(result, out.with_suffix(".png"))
    result["timeline"] = result["timeline"][::max(1, len(result["timeline"]) // 200)]
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("timeline", "config")}, indent=1))


if __name__ == "__main__":
    main()
