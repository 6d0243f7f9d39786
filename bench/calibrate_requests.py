"""A cost model for a server that logs no steps (vLLM: no `/steps`), from requests alone.

`kvgate calibrate --url VLLM_URL --out P.json` lands here when the server has no step log. Two
probes, one request shape each, every probe's time the median over `rounds`:
  decode:  b streams at once after a cached prefix, for each batch size b and two contexts;
           once all b decode, the clients' inter-token gap is one step of b decodes.
  prefill: fresh prompts of growing length, max_tokens=1, one at a time: TTFT is the request's
           overhead plus one prefill step.
The decode gaps give the step's base and per-sequence cost, the cost per KV token read and the
per-batch table (`bench.calibrate.decode_terms`, `decode_table`); the TTFTs then give the
per-request overhead and the prefill terms (per token and attention) by non-negative least
squares, with the base taken from the decodes. What it cannot see: steps that mix a prefill with
decodes (`mixed_ms` stays 0) and chunked prefill (prompts are kept within one step's budget).
"""

import asyncio
import sys
import time

import httpx
import numpy as np

from bench.calibrate import DECODE_SUFFIX, VOCAB, Probe, decode_table, decode_terms, nnls
from workers.internal_auth import internal_headers
from workers.kv.cost_model import CostModel

GAP_SKIP = 2  # a stream's first gaps may hold the other streams' prefills


async def decode_probe(p: Probe, batch: int, prefix: list[int], tokens: int) -> dict:
    recs = await asyncio.gather(*(p.one(prefix + p.prompt(DECODE_SUFFIX), tokens) for _ in range(batch)))
    gaps = [g for r in recs for g in r["itl_ms"][GAP_SKIP:]]
    ctx = len(prefix) + DECODE_SUFFIX + tokens / 2
    return {
        "kind": "decode",
        "key": ("decode", batch, len(prefix)),
        "batch": batch,
        "kv": batch * ctx,
        "gap_ms": float(np.median(gaps)),
        "ms": float(np.median(gaps)),
    }


async def prefill_probe(p: Probe, n: int) -> dict:
    rec = await p.one(p.prompt(n), 1)
    tokens = rec["prompt_tokens"] - rec["cached_tokens"]
    return {
        "kind": "prefill",
        "key": ("prefill", n),
        "tokens": tokens,
        "ctx": tokens * (rec["cached_tokens"] + tokens / 2),
        "ttft_ms": rec["ttft_ms"],
        "ms": rec["ttft_ms"],
    }


async def measure(
    url: str, model: str, lengths: list[int], batches: list[int], decode_tokens: int, seed: int, rounds: int
) -> list[dict]:
    p = Probe(url, model, seed, VOCAB)
    await p.one(p.prompt(max(lengths)), 2)  # warm up
    samples = []
    for r in range(rounds):
        prefixes = [p.prompt(n) for n in (min(lengths), max(lengths))]
        for prefix in prefixes:
            await p.one(prefix, 1)
        decodes = [await decode_probe(p, b, prefix, decode_tokens) for prefix in prefixes for b in batches]
        prefills = [await prefill_probe(p, n) for n in lengths]
        samples += decodes + prefills
        print(
            f"  {url} round {r + 1}/{rounds}: longest TTFT {prefills[-1]['ttft_ms']:.0f} ms; decode steps "
            + ", ".join(f"b={s['batch']} {s['gap_ms']:.0f} ms" for s in decodes[: len(batches)]),
            file=sys.stderr,
            flush=True,
        )
    await p.client.aclose()
    return samples


def fit(samples: list[dict]) -> dict:
    """CostModel terms and the per-request overhead from the probes' medians."""
    groups: dict = {}
    for s in samples:
        groups.setdefault(s["key"], []).append(s)
    points = [
        {
            **g[0],
            **{k: float(np.median([x[k] for x in g])) for k in ("ms", "gap_ms", "ttft_ms", "kv", "ctx") if k in g[0]},
        }
        for g in groups.values()
    ]
    dec = [s for s in points if s["kind"] == "decode"]
    pre = [s for s in points if s["kind"] == "prefill"]
    seq_ms, kv_ms = decode_terms(dec)
    table = decode_table(dec, kv_ms)
    base = max(0.0, (table[0] if table else min(s["gap_ms"] for s in dec)) - seq_ms)
    a = np.array([[1.0, s["tokens"], s["ctx"] / 1000.0] for s in pre])
    overhead, token_ms, attn_ms = nnls(a, np.array([s["ttft_ms"] - base for s in pre]))
    cost = CostModel(
        base_ms=base,
        prefill_token_ms=float(token_ms),
        prefill_attn_ms=float(attn_ms),
        decode_seq_ms=seq_ms,
        decode_kv_token_ms=kv_ms,
        decode_batch_ms=table,
        decode_batch_slope_ms=seq_ms,
    )
    fitted = [
        cost.decode_ms(s["batch"], int(s["kv"]))
        if s["kind"] == "decode"
        else overhead + cost.step_ms(s["tokens"], s["ctx"])
        for s in points
    ]
    measured = [s["gap_ms"] if s["kind"] == "decode" else s["ttft_ms"] for s in points]
    rel = [(f - m) / m for f, m in zip(fitted, measured) if m > 0]
    return {
        **cost.to_json(),
        "step_overhead_ms": 0.0,
        "request_overhead_ms": float(overhead),
        "fit_rel_rmse": float(np.sqrt(np.mean(np.square(rel)))),
        "fit": [
            {"measured_ms": m, "fitted_ms": f, **{k: v for k, v in s.items() if k != "key"}, "key": list(s["key"])}
            for s, m, f in zip(points, measured, fitted)
        ],
    }


def has_step_log(url: str) -> bool:
    """Whether the server logs its steps (a kvgate worker's GET /steps; vLLM answers 404)."""
    status = httpx.get(url + "/steps", params={"after": 2**62}, timeout=10, headers=internal_headers()).status_code
    if status in (401, 403):
        raise SystemExit(
            f"kvgate calibrate: {url} refuses /steps: give the fleet's internal token ($KVGATE_INTERNAL_TOKEN)"
        )
    return status == 200


def calibrate(
    urls: list[str], lengths: list[int], batches: list[int], decode_tokens: int = 24, seed: int = 0, rounds: int = 3
) -> dict:
    """Probe the servers at `urls` at once and fit one profile to all their samples."""
    models = httpx.get(urls[0] + "/v1/models", timeout=10).json()["data"]
    model, max_len = models[0]["id"], models[0].get("max_model_len") or 2048
    lengths = [n for n in lengths if n + 2 <= max_len]

    async def all_servers() -> list[dict]:
        runs = [measure(u, model, lengths, batches, decode_tokens, seed + i, rounds) for i, u in enumerate(urls)]
        return [s for samples in await asyncio.gather(*runs) for s in samples]

    profile = fit(asyncio.run(all_servers()))
    head = {
        "description": f"measured by kvgate calibrate (requests only: no step log) on {', '.join(urls)} "
        f"({model}) at {time.strftime('%Y-%m-%d %H:%M')}",
        "measured": True,
        "probes": "requests",
        "model": model,
        "workers": len(urls),
    }
    return {**head, **profile}
