"""Write a synthetic trace in the Mooncake format, for when the real one is out of reach.

Each line is {timestamp (ms), input_length, output_length, hash_ids}, hash_ids naming the
prompt's 512-token blocks so that equal ids are equal content. The generator imitates the
traits of the published Mooncake conversation trace that matter to a KV-aware router: long
prompts (mean ~7k tokens), short answers (mean ~200), a few popular shared prefixes (system
prompts, documents; Zipf popularity), and multi-turn sessions whose next prompt extends the
previous one. It is synthetic: the shapes are chosen, not measured.

    python -m bench.make_trace --requests 20000 --rate 20 --out bench/results/mooncake-synthetic.jsonl
"""

import argparse
import json
import sys

import numpy as np

BLOCK = 512


class TraceMaker:
    def __init__(self, seed: int, prefixes: int, followup: float, max_input: int):
        self.rng = np.random.default_rng(seed)
        self.followup = followup
        self.max_input = max_input
        self.next_id = 0
        self.prefixes = [self.fresh(int(self.rng.integers(1, 13))) for _ in range(prefixes)]
        weights = 1.0 / np.arange(1, prefixes + 1) ** 1.1
        self.popularity = weights / weights.sum()
        self.sessions: list[tuple[list[int], int, int]] = []

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def lognormal(self, mean: float, sigma: float, low: int, high: int) -> int:
        mu = np.log(mean) - sigma**2 / 2
        return int(np.clip(self.rng.lognormal(mu, sigma), low, high))

    def row(self, t_ms: int) -> dict:
        """A follow-up turn of a live session, or a new request on a popular prefix or none."""
        out = self.lognormal(200, 0.8, 1, 1024)
        if self.sessions and self.rng.random() < self.followup:
            k = int(self.rng.integers(len(self.sessions)))
            ids, length, prev_out = self.sessions[k]
            keep = ids[: length // BLOCK]
            n = min(self.max_input, length + prev_out + self.lognormal(300, 0.8, 16, 4096))
        else:
            k = len(self.sessions)
            self.sessions.append(([], 0, 0))
            keep = []
            if self.rng.random() < 0.8:
                keep = list(self.prefixes[int(self.rng.choice(len(self.prefixes), p=self.popularity))])
            n = min(self.max_input, len(keep) * BLOCK + self.lognormal(2500, 1.0, 16, 30000))
        ids = keep + self.fresh(-(-n // BLOCK) - len(keep))
        self.sessions[k] = (ids, n, out)
        if len(self.sessions) > 2000:
            self.sessions.pop(0)
        return {"timestamp": t_ms, "input_length": n, "output_length": out, "hash_ids": ids}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.make_trace", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--rate", type=float, default=20.0, help="mean requests per second (Poisson)")
    p.add_argument("--prefixes", type=int, default=40, help="popular shared prefixes")
    p.add_argument("--followup", type=float, default=0.45, help="share of requests that continue a session")
    p.add_argument("--max-input", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    maker = TraceMaker(args.seed, args.prefixes, args.followup, args.max_input)
    t = 0.0
    with open(args.out, "w") as f:
        for _ in range(args.requests):
            t += maker.rng.exponential(1000.0 / args.rate)
            f.write(json.dumps(maker.row(int(t)), separators=(",", ":")) + "\n")
    print(f"wrote {args.requests} requests to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
