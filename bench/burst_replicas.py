"""`python -m bench.burst_replicas`: does a burst split over two gateway replicas spread as it
would through one? (issue 16 point 4, end to end)

    python -m bench.burst_replicas --rounds 8 --burst 16 --out bench/results/burst_replicas.json

A redis-server, `--workers` sim workers publishing to it, and two gateway replicas that find
them there and share their in-flight load through it. Each round sends `--burst` requests with
one shared prefix (new each round, caches emptied before it) within `--window-ms`, every one
still running when the last is routed: once all to replica a ("one"), once alternating between
a and b ("two"). Per round the requests each worker got, sorted (6/6/2/2); the report gives the
mean of the largest share per mode and every round's split, JSON and a PNG. What good looks like:
"two" spreads like "one" (the largest share no higher).
"""

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from gateway.procs import Worker, start_gateway, start_redis, stop_all, wait_redis

MODEL = "smollm2-135m"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def burst(urls: list[str], prefix: str, n: int, window_ms: float, max_tokens: int) -> list[str]:
    """`n` requests sharing `prefix`, spread evenly over the window, the i-th to urls[i % len]:
    the worker each was routed to."""

    async def one(client: httpx.AsyncClient, i: int) -> str:
        await asyncio.sleep(i * window_ms / 1000 / max(1, n - 1))
        body = {"model": MODEL, "prompt": f"{prefix} question {i}", "max_tokens": max_tokens}
        r = await client.post(urls[i % len(urls)] + "/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        return r.headers["x-kvgate-worker"]

    async with httpx.AsyncClient() as client:
        return list(await asyncio.gather(*(one(client, i) for i in range(n))))


def split(workers: list[str], routed: list[str]) -> list[int]:
    """Requests per worker, largest first, zeros included."""
    counts = Counter(routed)
    return sorted((counts.get(w, 0) for w in workers), reverse=True)


def run(args: argparse.Namespace) -> dict:
    logs = args.log_dir
    server = wait_redis(start_redis(log_dir=logs))
    url = f"redis://127.0.0.1:{server.port}/0"
    extra = ["--sim-profile", args.profile] if args.profile else []
    workers = [Worker(worker_id=f"b{i}", redis=url, log_dir=logs, extra=extra) for i in range(args.workers)]
    gateways = [
        start_gateway([], args.policy, redis=url, name=f"replica-{c}", log_dir=logs, extra=["--replica-id", c])
        for c in "ab"
    ]
    rng = random.Random(args.seed)
    rounds = []
    try:
        for w in workers:
            w.ready()
        for g in gateways:
            g.wait_ready("/v1/models")
            g.wait_healthy(args.workers, timeout=30, what="fleet")
        ids = [w.worker_id for w in workers]
        a, b = (g.url for g in gateways)
        for r in range(args.rounds):
            prefix = text(rng, args.prefix_words)
            row = {"round": r}
            for mode, urls in (("one", [a]), ("two", [a, b])):
                for w in workers:
                    w.reset_cache()
                time.sleep(0.3)  # the resets' removals reach both replicas
                routed = asyncio.run(burst(urls, f"{prefix} {mode}", args.burst, args.window_ms, args.max_tokens))
                row[mode] = split(ids, routed)
            print(f"round {r}: one {row['one']}  two {row['two']}", file=sys.stderr, flush=True)
            rounds.append(row)
    finally:
        stop_all(gateways + workers + [server])
    mean_max = {m: sum(r[m][0] for r in rounds) / len(rounds) for m in ("one", "two")}
    return {
        "command": "python -m bench.burst_replicas " + " ".join(sys.argv[1:]),
        "config": {k: v for k, v in vars(args).items() if k != "log_dir"},
        "mean_largest_share": {m: v / args.burst for m, v in mean_max.items()},
        "mean_largest_count": mean_max,
        "rounds": rounds,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = report["rounds"]
    n = len(rounds[0]["one"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, (mode, color) in enumerate((("one", "tab:blue"), ("two", "tab:orange"))):
        mean = [sum(r[mode][i] for r in rounds) / len(rounds) for i in range(n)]
        xs = [i + (k - 0.5) * 0.38 for i in range(n)]
        label = "one replica" if mode == "one" else "two replicas (alternating)"
        ax.bar(xs, mean, width=0.38, color=color, label=label)
        for r in rounds:
            ax.scatter(xs, r[mode], color="black", s=6, zorder=3)
    ax.set_xticks(range(n), [f"busiest #{i + 1}" for i in range(n)])
    ax.set_ylabel(f"requests of a {report['config']['burst']}-request burst")
    ax.set_title(f"same-prefix bursts within {report['config']['window_ms']:.0f} ms ({report['config']['policy']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--policy", default="prefix_affinity")
    p.add_argument("--profile", default="bench/profiles/h200-llama8b-kvgate-eager.json", help="sim cost profile")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--window-ms", type=float, default=100.0)
    p.add_argument("--prefix-words", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=64, help="long enough that the burst is still running")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default="bench/results/burst_replicas.json")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(json.dumps({k: report[k] for k in ("mean_largest_share", "mean_largest_count")}))


if __name__ == "__main__":
    main()
