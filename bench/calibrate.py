"""`kvgate calibrate`: measure a real worker and fit the simulator's cost model to it.

    kvgate calibrate --url http://127.0.0.1:8100 --out bench/profiles/cpu-smollm2-135m.json
    kvgate calibrate --model smollm2-135m --executor torch --out PROFILE.json   # starts a worker

Three probes, one request shape each, so every engine step has a known composition:
  prefill: prompts of growing length, never seen before, max_tokens=1 (one prefill step each);
  cached prefill: a prompt, then the same prompt extended, so the step prefills after a
           cached prefix (this separates per-token cost from the attention term);
  decode:  b streams at once, for several b and prompt lengths (steps of b decodes).
The worker's `/state` `recent_steps` gives each step's executor time and composition
[ms, prefill_tokens, decode_seqs, kv_tokens]. What the engine does around the executor (its
per-step Python) is the client's inter-token gap minus the step's executor time; it is added
to every step. What a request costs outside steps (HTTP, parsing) is TTFT minus the step
and goes into the profile as `request_overhead_ms`, which the simulator adds to TTFT. The
five CostModel coefficients are fitted by non-negative least squares on relative error.
"""
import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

from bench.loadgen import send
from bench.workloads import BenchRequest, TOKEN_LOW
from workers.kv.cost_model import CostModel

VOCAB = 32000
COLUMNS = ("base_ms", "prefill_token_ms", "prefill_attn_ms", "decode_seq_ms", "decode_kv_token_ms")


class Probe:
    def __init__(self, url: str, model: str | None, seed: int, vocab: int):
        self.url, self.model = url, model
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.client = httpx.AsyncClient(timeout=600)
        self.index = 0

    def prompt(self, n: int) -> list[int]:
        return self.rng.integers(TOKEN_LOW, self.vocab, n).tolist()

    async def steps(self) -> list[list[float]]:
        return (await self.client.get(self.url + "/state")).json()["recent_steps"]

    async def one(self, prompt: list[int], max_tokens: int) -> dict:
        self.index += 1
        rec = await send(self.client, self.url, BenchRequest(self.index, 0.0, prompt, max_tokens),
                         self.model, {}, True)
        if rec["error"]:
            raise RuntimeError(f"calibration request failed: {rec['error']}")
        return rec

    async def prefill(self, prompt: list[int]) -> dict:
        """One prefill step: its executor ms, uncached and cached tokens, and the client TTFT."""
        rec = await self.one(prompt, 1)
        ms, tokens, seqs, _ = (await self.steps())[-1]
        cached = rec["cached_tokens"]
        assert seqs == 0 and tokens == len(prompt) - cached, "unexpected step: is the worker idle?"
        return {"kind": "prefill", "ms": ms, "tokens": tokens, "ctx": tokens * (cached + tokens / 2),
                "ttft_ms": rec["ttft_ms"]}

    async def decode(self, batch: int, prompt_len: int, tokens: int) -> dict:
        """b concurrent streams; the steps where all b decode, and the clients' median gap."""
        recs = await asyncio.gather(*(self.one(self.prompt(prompt_len), tokens) for _ in range(batch)))
        steps = [s for s in await self.steps() if s[1] == 0 and s[2] == batch]
        gaps = [g for r in recs for g in r["itl_ms"][2:]]
        return {"kind": "decode", "batch": batch, "kv": float(np.median([s[3] for s in steps])),
                "ms": float(np.median([s[0] for s in steps])), "gap_ms": float(np.median(gaps))}


async def measure(url: str, model: str | None, lengths: list[int], batches: list[int],
                  decode_tokens: int, seed: int, vocab: int) -> list[dict]:
    p = Probe(url, model, seed, vocab)
    samples = []
    await p.one(p.prompt(32), 4)
    for n in lengths:
        samples.append(await p.prefill(p.prompt(n)))
        print(f"  {url} prefill {n} tokens: {samples[-1]['ms']:.1f} ms", file=sys.stderr, flush=True)
    for n in lengths[len(lengths) // 2:]:
        base = p.prompt(n)
        await p.one(base, 1)
        samples.append(await p.prefill(base + p.prompt(max(16, n // 4))))
        print(f"  {url} prefill after {n} cached: {samples[-1]['ms']:.1f} ms", file=sys.stderr, flush=True)
    for b in batches:
        for n in (32, max(lengths)):
            samples.append(await p.decode(b, n, decode_tokens))
            print(f"  {url} decode batch {b} kv {samples[-1]['kv']:.0f}: step {samples[-1]['ms']:.1f} ms, "
                  f"gap {samples[-1]['gap_ms']:.1f} ms", file=sys.stderr, flush=True)
    await p.client.aclose()
    return samples


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by dropping the most negative column until none is."""
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[active] = np.linalg.lstsq(a[:, active], y, rcond=None)[0]
        if (x[active] >= 0).all():
            return x
        active.remove(active[int(np.argmin(x[active]))])


def fit(samples: list[dict]) -> dict:
    """CostModel coefficients, the per-step engine overhead and the per-request overhead."""
    dec = [s for s in samples if s["kind"] == "decode"]
    step_overhead = max(0.0, float(np.median([s["gap_ms"] - s["ms"] for s in dec if s["batch"] == min(d["batch"] for d in dec)])))
    rows, target = [], []
    for s in samples:
        if s["kind"] == "prefill":
            rows.append([1.0, s["tokens"], s["ctx"] / 1000.0, 0.0, 0.0])
            target.append(s["ms"] + step_overhead)
        else:
            rows.append([1.0, 0.0, 0.0, s["batch"], s["kv"]])
            target.append(s["gap_ms"])
    a, y = np.array(rows), np.array(target)
    coef = nnls(a / y[:, None], np.ones_like(y))
    pred = a @ coef
    cost = CostModel(**dict(zip(COLUMNS, map(float, coef))))
    request_overhead = [s["ttft_ms"] - (s["ms"] + step_overhead) for s in samples if s["kind"] == "prefill"]
    return {**cost.to_json(), "step_overhead_ms": step_overhead,
            "request_overhead_ms": max(0.0, float(np.median(request_overhead))),
            "fit_rel_rmse": float(np.sqrt(np.mean(((pred - y) / y) ** 2))),
            "fit": [{"measured_ms": float(t), "fitted_ms": float(f), **s} for s, t, f in zip(samples, y, pred)]}


def plot_fit(profile: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for kind, marker in (("prefill", "o"), ("decode", "s")):
        pts = [(f["measured_ms"], f["fitted_ms"]) for f in profile["fit"] if f["kind"] == kind]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=kind)
    top = max(f["measured_ms"] for f in profile["fit"]) * 1.1
    ax.plot([0, top], [0, top], "k--", linewidth=1)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("cost model (ms)")
    ax.set_title(f"{profile.get('model')}: fit rel. RMSE {profile['fit_rel_rmse']:.1%}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def start_worker(model: str, executor: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """A `kvgate worker` on a free port in its own process group; returns (process, url)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "gateway.cli", "worker", "--model", model, "--executor", executor,
            "--port", str(port), "--worker-id", "calibrate", *extra]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    stop_worker(proc)
    raise RuntimeError(f"worker for {model} did not come up")


def stop_worker(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def calibrate(urls: list[str], lengths: list[int], batches: list[int], decode_tokens: int = 24,
              seed: int = 0) -> dict:
    """Measure the workers at `urls` (at the same time, so a fleet sharing one machine is
    measured under its own contention) and return one profile fitted to all their samples."""
    state = httpx.get(urls[0] + "/state", timeout=10).json()
    model = state.get("model")
    lengths = [n for n in lengths if n <= state.get("max_batched_tokens", 2048)]

    async def all_workers() -> list[dict]:
        runs = [measure(u, model, lengths, batches, decode_tokens, seed + i, VOCAB) for i, u in enumerate(urls)]
        return [s for samples in await asyncio.gather(*runs) for s in samples]

    profile = fit(asyncio.run(all_workers()))
    head = {"description": f"measured by kvgate calibrate on {', '.join(urls)} ({model}) at "
                           f"{time.strftime('%Y-%m-%d %H:%M')}",
            "measured": True, "model": model, "workers": len(urls), "block_size": state.get("block_size"),
            "max_batched_tokens": state.get("max_batched_tokens")}
    return {**head, **profile}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvgate calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", action="append",
                        help="a running worker; repeat to measure several at once (pooled into one profile)")
    target.add_argument("--model", help="start `kvgate worker --model MODEL` for the measurement")
    p.add_argument("--executor", default="torch", help="with --model: the worker's executor")
    p.add_argument("--worker-arg", action="append", default=[], help="with --model: extra worker flag (repeatable)")
    p.add_argument("--lengths", default="16,32,64,128,256,512", help="prefill lengths (tokens)")
    p.add_argument("--batches", default="1,2,4,8", help="decode batch sizes")
    p.add_argument("--decode-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="profile JSON (a -fit.png plot is written next to it)")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    proc = None
    urls = args.url
    if args.model:
        proc, url = start_worker(args.model, args.executor, args.worker_arg)
        urls = [url]
    try:
        profile = calibrate([u.rstrip("/") for u in urls], lengths, batches, args.decode_tokens, args.seed)
    finally:
        if proc is not None:
            stop_worker(proc)
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    plot_fit(profile, args.out[:-5] + "-fit.png" if args.out.endswith(".json") else args.out + "-fit.png")
    print(json.dumps({k: profile[k] for k in (*COLUMNS, "step_overhead_ms", "request_overhead_ms", "fit_rel_rmse")}),
          file=sys.stderr)
