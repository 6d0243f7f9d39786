"""Issue 22 on a GPU: a copy back from the host tier runs beside the steps, not inside them.

Two parts, one JSON:
1. Engine: A runs, B's prefill evicts A's blocks to host, C decodes while A runs again: the
   blocks back from host must hold A's first K/V bit for bit, A's tokens equal those of the same
   prefix hit from device blocks (bf16 on a GPU: a prefix hit need not give the tokens of a full
   prefill), C's those of C alone, and A must have waited in the scheduler's `loading` for at
   least one step while C stepped.
2. Runner: decode steps timed alone, with a copy back of N blocks in flight on the copy stream,
   and after one (serial, as before the copy stream); plus the copy's own time.

Usage (device tool, repo root, carry .devcarry); the PNG is drawn beside the JSON:
  PYTHONPATH=. python3 experiments/copy_back_overlap.py --tokenizer-dir .devcarry --init-device cuda \
    --out $OUT/copy_back_overlap_h200_1b.json
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.random_model import add_args, make_model
from workers.config import EngineConfig
from workers.engine import Engine
from workers.executors.batch import SeqChunk
from workers.executors.torch_runner import TorchRunner
from workers.model_store import load_tokenizer
from workers.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def run_alone(engine: Engine, rid: str, prompt: list[int], n: int) -> list[int]:
    outs: list = []
    engine.submit(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), outs.append)
    while engine.has_work():
        engine.step()
    return [t for o in outs for t in o.token_ids]


def engine_part(model: str, device: str, block: int) -> dict:
    """A's round trip beside C's decode, checked against recompute."""
    tok = load_tokenizer(model)
    a, b, c = list(range(1000, 1000 + 20 * block + 3)), list(range(3000, 3000 + 60 * block)), list(range(5000, 5010))
    engine = Engine(
        TorchRunner(model, 64, block, device=device), tok, EngineConfig("m", block, 64, 512, 8, host_blocks=256)
    )
    first = run_alone(engine, "a", a, 8)
    hashes = engine.pool.resident_hashes()
    before = {h: engine.executor.read_blocks([engine.pool._by_hash[h]]).clone() for h in hashes}
    run_alone(engine, "b", b, 2)
    spilled = [h for h in hashes if h not in engine.pool._by_hash and h in engine.pool.host]
    outs: dict[str, list] = {"c": [], "a2": []}
    engine.submit("c", c, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), outs["c"].append)
    engine.step()
    engine.submit("a2", a, GREEDY, outs["a2"].append)
    waited, c_during = 0, 0
    while engine.has_work():
        stepped = {o.request_id for o in engine.step() if o.token_ids}
        if engine.scheduler.loading:
            waited += 1
            c_during += "c" in stepped
    again = [t for o in outs["a2"] for t in o.token_ids]
    back = [h for h in spilled if h in engine.pool._by_hash]
    same_kv = all(torch.equal(engine.executor.read_blocks([engine.pool._by_hash[h]]), before[h]) for h in back)
    c_tokens = [t for o in outs["c"] for t in o.token_ids]
    alone = Engine(TorchRunner(model, 64, block, device=device), tok, EngineConfig("m", block, 64, 512, 8))
    c_ref = run_alone(alone, "c", c, 40)
    run_alone(alone, "a", a, 8)
    device_hit = run_alone(alone, "a2", a, 8)  # the same prefix hit from device blocks
    return {
        "blocks_back_from_host": len(back),
        "kv_bitwise_equal_after_round_trip": same_kv,
        "a_tokens_equal_first_run": again == first,
        "a_tokens_equal_device_prefix_hit": again == device_hit,
        "c_tokens_equal": c_tokens == c_ref,
        "cached_tokens": outs["a2"][-1].num_cached,
        "steps_a_waited": waited,
        "c_tokens_while_a_waited": c_during,
        "host_loaded_blocks": engine.stats.host_loaded_blocks,
        "free_blocks_back": engine.pool.num_free == engine.pool.num_blocks,
    }


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def wait_copy(runner: TorchRunner, handle: object) -> None:
    if handle is not None:
        runner.copy_done(handle, wait=True)


def timed_steps(runner: TorchRunner, chunks: list[SeqChunk], k: int, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(k):
        runner.execute(chunks)
    sync(device)
    return (time.perf_counter() - t0) * 1000 / k


def runner_part(model: str, device: str, block: int, copy_blocks: int, batch: int, k: int) -> dict:
    """Decode steps alone, beside an in-flight copy back, and after a waited-for one."""
    ctx = 512
    per_seq = ctx // block + 1
    runner = TorchRunner(model, batch * per_seq + copy_blocks, block, device=device)
    runner.allocate_host_cache(copy_blocks)
    runner.host_cache.normal_()
    chunks = [
        SeqChunk([7], ctx, list(range(i * per_seq, (i + 1) * per_seq)), True, GREEDY, output_index=1)
        for i in range(batch)
    ]
    dst = list(range(batch * per_seq, batch * per_seq + copy_blocks))
    slots = list(range(copy_blocks))
    timed_steps(runner, chunks, 3, device)  # warm-up
    alone = timed_steps(runner, chunks, k, device)
    sync(device)
    t0 = time.perf_counter()
    wait_copy(runner, runner.swap_in(dst, slots))
    copy_ms = (time.perf_counter() - t0) * 1000
    sync(device)
    t0 = time.perf_counter()
    handle = runner.swap_in(dst, slots)
    for _ in range(k):
        runner.execute(chunks)
    wait_copy(runner, handle)
    sync(device)
    beside = (time.perf_counter() - t0) * 1000
    kv_bytes = copy_blocks * block * runner.kv_bytes_per_token
    return {
        "copy_blocks": copy_blocks,
        "copy_bytes": kv_bytes,
        "copy_ms": copy_ms,
        "copy_gbps": kv_bytes / copy_ms / 1e6,
        "decode_batch": batch,
        "decode_context": ctx,
        "steps": k,
        "step_ms_alone": alone,
        "k_steps_with_copy_beside_ms": beside,
        "k_steps_then_copy_serial_ms": alone * k + copy_ms,
    }


def plot(result: dict, path: str) -> None:
    """The runner part as bars: k decode steps alone, with the copy back beside them, and the
    copy waited for before them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = result["runner"]
    bars = {
        f"{r['steps']} decode steps": r["step_ms_alone"] * r["steps"],
        "the same steps,\ncopy back beside": r["k_steps_with_copy_beside_ms"],
        "copy back, then\nthe steps (serial)": r["k_steps_then_copy_serial_ms"],
    }
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(bars), list(bars.values()), color=["#888", "#2a7", "#c44"])
    ax.set_ylabel("ms")
    mib = r["copy_bytes"] / 2**20
    ax.set_title(
        f"{result['device']}: copy back of {mib:.0f} MiB ({r['copy_gbps']:.0f} GB/s)\n"
        f"beside {r['steps']} decode steps of {r['decode_batch']} seqs",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    p.add_argument("--device", default="cuda")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--copy-blocks", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_model(args, Path(tmp)))
        result = {
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
            "model": {
                "layers": args.layers,
                "hidden": args.hidden,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
            },
            "engine": engine_part(model, args.device, args.block_size),
            "runner": runner_part(model, args.device, args.block_size, args.copy_blocks, args.batch, args.steps),
        }
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))
    plot(result, str(Path(args.out).with_suffix(".png")))


if __name__ == "__main__":
    main()
