"""How long a gateway replica takes to rebuild its residency index from Redis at start-up.

A private redis-server holds `--workers` registered workers of equal resident sets; the
replica's `RedisState.bootstrap` reads them into a fresh `ResidencyIndex`. Timed for growing
totals of resident blocks (target: 100k blocks under 1 s). JSON and PNG out.

  python -m bench.redis_bootstrap [--blocks 25000,50000,100000] [--workers 8] [--out bench/results]
"""

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import redis

from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.procs import TEST_TOKEN, start_redis, wait_redis
from gateway.redis_state import RedisState
from workers.kv import redis_schema as rs

MODEL = "smollm2-135m"


def populate(client: redis.Redis, total_blocks: int, workers: int, seed: int = 0) -> None:
    """`workers` registered workers holding `total_blocks` random hashes between them."""
    rng = random.Random(seed)
    client.flushall()
    for i in range(workers):
        wid = f"big{i}"
        client.sadd(rs.resident_key(MODEL, wid), *[rng.getrandbits(64) for _ in range(total_blocks // workers)])
        client.set(rs.seq_key(MODEL, wid), 1000 + i)
        reg = rs.Registration(wid, f"http://127.0.0.1:{20 + i}", MODEL, time.time()).signed(TEST_TOKEN)
        client.set(rs.heartbeat_key(MODEL, wid), json.dumps(reg.to_json()), px=600_000)
        client.sadd(rs.workers_key(MODEL), wid)
    client.sadd(rs.POOLS, MODEL)


async def bootstrap_s(url: str) -> tuple[float, ResidencyIndex]:
    """Seconds one `bootstrap` took, and the index it built."""
    fleet = Fleet(ResidencyIndex())
    state = RedisState(url, fleet, TEST_TOKEN)
    client = state.client()
    t0 = time.perf_counter()
    await state.bootstrap(client)
    took = time.perf_counter() - t0
    await client.aclose()
    return took, fleet.index


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["blocks"] for r in rows], [r["best_s"] for r in rows], "o-", label="best")
    ax.plot([r["blocks"] for r in rows], [r["median_s"] for r in rows], "s--", label="median")
    ax.axhline(1.0, color="k", linestyle=":", linewidth=1, label="target (1 s)")
    ax.set_xlabel("resident blocks in Redis")
    ax.set_ylabel("bootstrap (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.redis_bootstrap", description=__doc__.split("\n")[0])
    p.add_argument("--blocks", default="25000,50000,100000")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc = wait_redis(start_redis(log_dir=tempfile.mkdtemp(prefix="kvgate-bench-")))
    rows = []
    try:
        client = redis.Redis(port=proc.port)
        for total in (int(x) for x in args.blocks.split(",")):
            populate(client, total, args.workers)
            runs = [asyncio.run(bootstrap_s(f"redis://127.0.0.1:{proc.port}/0")) for _ in range(args.repeats)]
            times = sorted(t for t, _ in runs)
            indexed = [index.num_blocks() for _, index in runs]
            if any(n != total // args.workers * args.workers for n in indexed):
                raise RuntimeError(f"bootstrap indexed {indexed} of {total} blocks")
            rows.append(
                {
                    "blocks": total,
                    "workers": args.workers,
                    "best_s": times[0],
                    "median_s": times[len(times) // 2],
                    "runs_s": times,
                }
            )
            print(f"  {total} blocks: best {times[0]:.3f} s, median {times[len(times) // 2]:.3f} s", flush=True)
    finally:
        proc.stop()
    result = {"rows": rows, "target": {"blocks": 100_000, "under_s": 1.0}}
    (out / "redis_bootstrap.json").write_text(json.dumps(result, indent=2))
    plot(rows, out / "redis_bootstrap.png")
    print(f"wrote {out / 'redis_bootstrap.json'} and .png")


if __name__ == "__main__":
    main()
