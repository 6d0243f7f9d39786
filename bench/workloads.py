"""Request streams for benchmarks and the simulator: who asks what, and when.

Each workload yields `BenchRequest`s in arrival order as prompt token ids, so the same stream
drives a real endpoint (`prompt` as a list of ints) and the simulator, and equal prefixes are
equal token ids (hence equal block hashes) wherever they run. Streams are lazy: the simulator
holds only requests in flight, not minutes of prompts. Everything is seeded.

`mixed` interleaves two kinds of traffic, the case for prefill/decode disaggregation: with
probability `long_fraction` a long-document request (a fresh document of `input_len` tokens,
uniform in [L/2, 3L/2], to summarise in `long_output_len` tokens: long prefill, short decode),
otherwise a chat turn (a shared `prefix_len`-token system prompt plus a fresh `question_len`-token
question, answered in `output_len` tokens: short prefill, long decode). On a mixed worker every
long prefill stalls the chats decoding beside it.
"""

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from functools import lru_cache

import numpy as np

WORKLOADS = ("shared-prefix", "multi-turn", "long-doc-qa", "skewed", "random", "mixed", "trace")
TRACE_BLOCK = 512
TOKEN_LOW = 100

# Per-workload defaults for the knobs left unset on the command line.
DEFAULTS = {
    "shared-prefix": dict(groups=16, prefix_len=2048, question_len=128, output_len=128),
    "long-doc-qa": dict(groups=4, prefix_len=8192, question_len=64, output_len=64),
    "skewed": dict(groups=48, prefix_len=2048, question_len=128, output_len=128, hot="0.4,0.2"),
    "multi-turn": dict(prefix_len=512, question_len=128, output_len=128, turns=8, think_s=5.0),
    "random": dict(input_len=1024, output_len=128),
    "mixed": dict(
        long_fraction=0.2, input_len=4096, long_output_len=64, prefix_len=512, question_len=128, output_len=256
    ),
    "trace": dict(),
}


@dataclass
class BenchRequest:
    index: int
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    session: str | None = None


@dataclass
class WorkloadConfig:
    """Every knob of every workload; `None` means the workload's default from DEFAULTS."""

    name: str = "shared-prefix"
    rate: float = 10.0
    duration_s: float = 60.0
    arrival: str = "poisson"
    burstiness: float = 1.0
    seed: int = 0
    vocab_size: int = 32000
    groups: int | None = None
    prefix_len: int | None = None
    question_len: int | None = None
    output_len: int | None = None
    input_len: int | None = None
    turns: int | None = None
    think_s: float | None = None
    long_fraction: float | None = None
    long_output_len: int | None = None
    trace: str | None = None
    hot: str | None = None

    def get(self, knob: str):
        v = getattr(self, knob)
        return DEFAULTS[self.name].get(knob) if v is None else v

    def with_rate(self, rate: float) -> "WorkloadConfig":
        return WorkloadConfig(**{**self.__dict__, "rate": rate})


def add_args(p: argparse.ArgumentParser) -> None:
    """The workload flags shared by `kvgate bench serve` and `kvgate simulate`."""
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="shared-prefix",
        help="the request stream (bench/workloads.py describes each)",
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson", help="inter-arrival distribution")
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="coefficient of variation of gamma inter-arrival times (>1 is bursty)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals and prompts")
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn below this")
    for knob, doc in KNOBS.items():
        kind = float if knob in ("think_s", "long_fraction") else int
        p.add_argument("--" + knob.replace("_", "-"), type=kind, default=None, help=f"{doc} ({knob_defaults(knob)})")
    p.add_argument(
        "--hot",
        default=None,
        help="skewed: the shares of requests for the first prefixes, e.g. 0.4,0.2: the rest spread evenly "
        f"({knob_defaults('hot')})",
    )
    p.add_argument("--trace", help="Mooncake-format JSONL (timestamp ms, input_length, output_length, hash_ids)")


KNOBS = {
    "groups": "prompt groups sharing a prefix",
    "prefix_len": "tokens of the shared prefix (system prompt, document)",
    "question_len": "tokens of a request's own question",
    "output_len": "tokens to generate",
    "input_len": "tokens of a random or long-document prompt",
    "turns": "multi-turn: turns per conversation",
    "long_output_len": "mixed: tokens to generate for a long document",
    "think_s": "multi-turn: mean gap between turns, seconds",
    "long_fraction": "mixed: share of long-document requests",
}


def knob_defaults(knob: str) -> str:
    """'default: 2048 for shared-prefix, 8192 for long-doc-qa', from DEFAULTS."""
    found = [f"{d[knob]} for {name}" for name, d in DEFAULTS.items() if knob in d]
    return "default: " + ", ".join(found) if found else "no default"


def from_args(args: argparse.Namespace, rate: float) -> WorkloadConfig:
    known = {f.name for f in fields(WorkloadConfig)} - {"name", "rate", "duration_s"}
    kw = {k: v for k, v in vars(args).items() if k in known}
    return WorkloadConfig(**kw, name=args.workload, rate=rate, duration_s=args.duration)


def resolve_rates(args: argparse.Namespace, rates: list[float]) -> list[float]:
    """The rates given on the command line, checked; 0 stands for a trace's own mean rate
    (its requests at their own timestamps) and is refused for the other workloads."""
    for r in rates:
        if r < 0 or (r == 0 and args.workload != "trace"):
            raise SystemExit(f"request rates must be > 0 (0 replays --workload trace at its own timestamps); got {r:g}")
    if 0 in rates and not args.trace:
        raise SystemExit("the trace workload needs --trace FILE.jsonl")
    return [trace_rate(args.trace) if r == 0 else r for r in rates]


def trace_rate(path: str) -> float:
    """A trace's mean request rate, first to last timestamp: replayed at it, no time is scaled."""
    stamps = sorted(r["timestamp"] for r in read_trace(path))
    span = (stamps[-1] - stamps[0]) / 1000.0 if stamps else 0.0
    if span <= 0:
        raise SystemExit(f"{path}: a trace needs two or more distinct timestamps to have a rate")
    return len(stamps) / span


def arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> Iterator[float]:
    """Arrival times in [0, duration): Poisson, or gamma with coefficient of variation
    `burstiness` (shape 1/CV^2), which at CV > 1 clusters requests into bursts at the same mean rate."""
    if cfg.rate <= 0:
        return
    t = 0.0
    while True:
        if cfg.arrival == "gamma":
            shape = 1.0 / cfg.burstiness**2
            t += rng.gamma(shape, 1.0 / (cfg.rate * shape))
        else:
            t += rng.exponential(1.0 / cfg.rate)
        if t >= cfg.duration_s:
            return
        yield t


def tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(TOKEN_LOW, vocab_size, n).tolist()


def generate(cfg: WorkloadConfig) -> Iterator[BenchRequest]:
    """The request stream `cfg` describes, in arrival order."""
    if cfg.name not in WORKLOADS:
        raise ValueError(f"unknown workload {cfg.name!r}; choose from {', '.join(WORKLOADS)}")
    if cfg.name == "trace":
        return trace(cfg)
    return {
        "shared-prefix": shared_prefix,
        "long-doc-qa": shared_prefix,
        "skewed": shared_prefix,
        "multi-turn": multi_turn,
        "random": random_prompts,
        "mixed": mixed,
    }[cfg.name](cfg)


def shared_prefix(cfg: WorkloadConfig) -> Iterator[BenchRequest]:
    """G groups, each with an L-token system prompt (or document), plus a fresh Q-token
    question per request; `long-doc-qa` is the same shape with few, long prefixes, `skewed`
    with a few hot prefixes (`hot`: their shares of requests) among many cold ones."""
    rng = np.random.default_rng(cfg.seed)
    groups, out = cfg.get("groups"), cfg.get("output_len")
    prefixes = [tokens(rng, cfg.get("prefix_len"), cfg.vocab_size) for _ in range(groups)]
    weights = group_weights(groups, cfg.get("hot"))
    for i, t in enumerate(arrivals(cfg, rng)):
        g = int(rng.integers(groups)) if weights is None else int(rng.choice(groups, p=weights))
        prompt = prefixes[g] + tokens(rng, cfg.get("question_len"), cfg.vocab_size)
        yield BenchRequest(i, t, prompt, out, f"group-{g}")


def group_weights(groups: int, hot: str | None) -> np.ndarray | None:
    """Per-group request shares: the `hot` ones first ("0.4,0.2"), the rest shared evenly by
    the other groups; None (uniform) without `hot`."""
    if not hot:
        return None
    shares = [float(x) for x in hot.split(",")]
    if len(shares) >= groups or any(x < 0 for x in shares) or sum(shares) > 1:
        raise ValueError(f"hot shares {hot!r} need fewer than {groups} groups, each >= 0, summing to <= 1")
    rest = (1.0 - sum(shares)) / (groups - len(shares))
    return np.array(shares + [rest] * (groups - len(shares)))


def random_prompts(cfg: WorkloadConfig) -> Iterator[BenchRequest]:
    """No sharing: prompt lengths uniform in [L/2, 3L/2]."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.get("input_len")
    for i, t in enumerate(arrivals(cfg, rng)):
        length = int(rng.integers(max(1, n // 2), n + n // 2 + 1))
        yield BenchRequest(i, t, tokens(rng, length, cfg.vocab_size), cfg.get("output_len"))


def mixed(cfg: WorkloadConfig) -> Iterator[BenchRequest]:
    """Long-document summaries (a fraction `long_fraction`) among chat turns; see the module
    docstring. Chats share their system prompt, so they share a session as shared-prefix
    groups do; documents are unique and have none."""
    rng = np.random.default_rng(cfg.seed)
    system = tokens(rng, cfg.get("prefix_len"), cfg.vocab_size)
    n, q = cfg.get("input_len"), cfg.get("question_len")
    for i, t in enumerate(arrivals(cfg, rng)):
        if rng.random() < cfg.get("long_fraction"):
            length = int(rng.integers(max(1, n // 2), n + n // 2 + 1))
            yield BenchRequest(i, t, tokens(rng, length, cfg.vocab_size), cfg.get("long_output_len"))
        else:
            yield BenchRequest(i, t, system + tokens(rng, q, cfg.vocab_size), cfg.get("output_len"), "chat")


def multi_turn(cfg: WorkloadConfig) -> Iterator[BenchRequest]:
    """Chat sessions of `turns` turns that all open with the same system prompt.

    A turn's prompt is the previous prompt + the previous answer + a new question. The answer
    is planned here (a real model or the simulator says something else), so what a later turn
    can hit in cache is the previous turn's prompt. Arrivals are dealt round-robin to
    ceil(rate * think_s) session slots, so a session's turns are about `think_s` apart at any
    rate; a slot whose session is done starts a new one. The first session of each slot
    joins at a random turn (with its history made up), so the mix of turns is steady from
    the start rather than only after `turns * think_s` seconds.
    """
    rng = np.random.default_rng(cfg.seed)
    system = tokens(rng, cfg.get("prefix_len"), cfg.vocab_size)
    q, out, turns = cfg.get("question_len"), cfg.get("output_len"), cfg.get("turns")
    slots: list[tuple[str, int, list[int]] | None] = [None] * max(1, math.ceil(cfg.rate * cfg.get("think_s")))
    sessions = 0
    for i, t in enumerate(arrivals(cfg, rng)):
        k = i % len(slots)
        if slots[k] is None or slots[k][1] >= turns:
            turn = int(rng.integers(turns)) if slots[k] is None else 0
            slots[k] = (f"session-{sessions}", turn, system + tokens(rng, turn * (q + out), cfg.vocab_size))
            sessions += 1
        sid, turn, context = slots[k]
        prompt = context + tokens(rng, q, cfg.vocab_size)
        slots[k] = (sid, turn + 1, prompt + tokens(rng, out, cfg.vocab_size))
        yield BenchRequest(i, t, prompt, out, sid)


def read_trace(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@lru_cache(maxsize=16384)
def trace_block(hash_id: int, seed: int, vocab_size: int) -> tuple[int, ...]:
    """The 512 token ids standing for one trace hash id: equal ids give equal tokens."""
    rng = np.random.default_rng([seed, hash_id])
    return tuple(rng.integers(TOKEN_LOW, vocab_size, TRACE_BLOCK).tolist())


def trace_prompt(row: dict, index: int, cfg: WorkloadConfig) -> list[int]:
    """Concatenated blocks of the row's hash ids, cut to `input_length`; a trace that lists too
    few blocks is padded with tokens unique to this request."""
    n = int(row["input_length"])
    prompt: list[int] = []
    for h in row.get("hash_ids", ()):
        if len(prompt) >= n:
            break
        prompt.extend(trace_block(int(h), cfg.seed, cfg.vocab_size))
    if len(prompt) < n:
        rng = np.random.default_rng([cfg.seed, 1 << 40, index])
        prompt.extend(tokens(rng, n - len(prompt), cfg.vocab_size))
    return prompt[:n]


def trace(cfg: WorkloadConfig) -> Iterator[BenchRequest]:
    """Replay a Mooncake-format trace. With `rate` > 0 the timestamps are rescaled so the
    trace's mean rate becomes `rate` (a sweep replays the same requests faster or slower)."""
    if not cfg.trace:
        raise ValueError("the trace workload needs --trace FILE.jsonl")
    rows = sorted(read_trace(cfg.trace), key=lambda r: r["timestamp"])
    if not rows:
        return
    t0 = rows[0]["timestamp"] / 1000.0
    span = rows[-1]["timestamp"] / 1000.0 - t0
    scale = (len(rows) / span) / cfg.rate if cfg.rate > 0 and span > 0 else 1.0
    for i, row in enumerate(rows):
        t = (row["timestamp"] / 1000.0 - t0) * scale
        if t >= cfg.duration_s:
            return
        yield BenchRequest(
            i,
            t,
            trace_prompt(row, i, cfg),
            max(1, int(row["output_length"])),
            str(row["session"]) if "session" in row else None,
        )
