"""How fast the gateway turns vLLM KV events into residency: blocks per second through the whole
event path in one process (msgpack frames decoded, each stored block's token ids re-hashed into
kvgate's chain at the gateway's block size, the changes applied to a residency index), on the
recorded vLLM 0.32 batches (tests/data) and on synthetic ones shaped like vLLM's (a step storing
a few prompts' blocks, evicting as many as it stores once the cache is full).

    python -m bench.vllm_events_bench [--out F.json]
"""

import argparse
import json
import random
import time
from pathlib import Path

import msgpack

from gateway.index import ResidencyIndex
from gateway.vllm_batch import decode_frames, decode_replay
from gateway.vllm_translate import Translator
from gateway.vllm_worker import IndexSink

RECORDED = Path(__file__).resolve().parents[1] / "tests" / "data" / "vllm-0.32-events.msgpack"

MODEL = "smollm2-135m"


def synthetic(
    batches: int, blocks_per_batch: int, engine_block: int = 32, cache_blocks: int = 4096, seed: int = 0
) -> list[list[bytes]]:
    """vLLM-framed PUB messages: each batch stores one prompt's fresh chain of blocks and, once
    `cache_blocks` are held, removes the oldest ones as it stores."""
    rng = random.Random(seed)
    held: list[int] = []
    out, next_hash = [], 1
    for seq in range(batches):
        hashes = list(range(next_hash, next_hash + blocks_per_batch))
        next_hash += blocks_per_batch
        tokens = [rng.randrange(100, 49000) for _ in range(blocks_per_batch * engine_block)]
        events = []
        if len(held) + blocks_per_batch > cache_blocks:
            gone, held = held[:blocks_per_batch], held[blocks_per_batch:]
            events += [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in gone]
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": None,
                "token_ids": tokens,
                "block_size": engine_block,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        )
        held += hashes
        out.append([b"kv", seq.to_bytes(8, "big"), msgpack.packb([time.time(), events, 0], use_bin_type=True)])
    return out


def run(messages: list[list[bytes]], block_size: int, replay: bool = False) -> dict:
    """Push `messages` through decode, translation and the index; blocks/s of engine blocks."""
    index = ResidencyIndex()
    sink = IndexSink(index, "w", lambda: False)
    sink.reset()
    t = Translator(MODEL, block_size)
    decode = decode_replay if replay else decode_frames
    t0 = time.perf_counter()
    for m in messages:
        batch = decode(m)
        if batch is None:
            continue
        changes = t.apply(batch.events)
        if changes:
            sink.apply(changes)
    dt = time.perf_counter() - t0
    blocks = t.stats.stored_blocks + t.stats.removed_blocks
    return {
        "messages": len(messages),
        "engine_blocks": blocks,
        "seconds": dt,
        "blocks_per_s": blocks / dt,
        "us_per_block": dt / blocks * 1e6,
        "resident_hashes": index.num_blocks("w"),
    }


def translate_throughput(repeats: int = 200) -> dict:
    recorded = msgpack.unpackb(RECORDED.read_bytes(), raw=False)["replay"]  # tests/data/README.md
    out = {"recorded_vllm_0.32": {bs: run(recorded * 1, bs, replay=True) for bs in (16, 32)}}
    best = [run(recorded, 16, replay=True) for _ in range(repeats)]
    out["recorded_vllm_0.32"]["16_repeated"] = {
        "blocks_per_s": sum(b["engine_blocks"] for b in best) / sum(b["seconds"] for b in best),
        "runs": repeats,
    }
    for per in (4, 16, 64):
        out[f"synthetic_{per}_blocks_per_step"] = {bs: run(synthetic(2000, per), bs) for bs in (16, 32)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.vllm_events_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out")
    args = p.parse_args(argv)
    result = translate_throughput()
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
