"""`kvgate calibrate`: measure a real worker and fit the simulator's cost model to it.

    kvgate calibrate --url http://127.0.0.1:8100 --out bench/profiles/cpu-smollm2-135m.json
    kvgate calibrate --model smollm2-135m --executor torch --out PROFILE.json   # starts a worker
    kvgate calibrate --url http://127.0.0.1:8100 --rescale PROFILE.json --out NOW.json
    kvgate calibrate --url http://VLLM:8000 --out vllm.json   # no /steps: requests only (calibrate_requests)

Three probes, one request shape each, so every engine step has a known composition:
  prefill: prompts of growing length, never seen before, max_tokens=1 (one prefill step each);
  cached prefill: a prompt, then the same prompt extended, so the step prefills after a
           cached prefix (this separates per-token cost from the attention term);
  decode:  b streams at once after a cached prefix (steps of b decodes), for each batch size b
           and two context lengths; once all b decode, one more request joins them, so one
           step prefills beside b decodes (a mixed step, the usual step under load).
The worker's step log (GET /steps) gives each step's executor time and composition, so a probe
reads every step it caused however many there were. What the engine does around the executor (its
per-step Python) is the client's inter-token gap minus the step's executor time; it is added
to every step. What a request costs outside steps (HTTP, parsing) is TTFT minus the step and
goes into the profile as `request_overhead_ms`, which the simulator adds to TTFT.

`--rescale PROFILE` measures nothing itself: it keeps PROFILE's shape and rescales its speed,
prefill and decode each by its own factor, to the steps the workers logged serving real
traffic (GET /steps): on a machine whose speed drifts (other jobs, clocks) that is the
machine as the traffic found it.

The probes run in `rounds`, each round all of them in turn with the prefill and decode probes
interleaved, and every probe's time is the median over the rounds: on a machine shared with
other jobs a burst of load then inflates one sample of every kind, not every sample of one
kind (which skews the fit). Steps that only decode get their measured time per batch size
(`decode_batch_ms`, since small batches are not linear in their size), and from its larger
batches the growth per sequence past it and the cost of a KV token; the other CostModel terms
(`mixed_ms` too) are fitted by non-negative least squares on relative error to the steps that
prefill, alone or beside decodes.
"""

import asyncio
import sys
import time
from collections import defaultdict

import httpx
import numpy as np

from bench.loadgen import send
from bench.workloads import BenchRequest, TOKEN_LOW
from gateway.upstream import UPSTREAM_KEEPALIVE_S, Pool
from workers.internal_auth import internal_headers
from workers.kv.cost_model import CostModel
from workers.step_stats import StepRecord

VOCAB = 32000
COLUMNS = ("base_ms", "prefill_token_ms", "prefill_attn_ms", "decode_seq_ms", "decode_kv_token_ms", "mixed_ms")
DECODE_SUFFIX = 16  # fresh tokens after the cached prefix of each decode stream
MEASURED = ("ms", "gap_ms", "ttft_ms", "kv", "ctx")  # what varies from round to round


class Probe:
    def __init__(self, url: str, model: str | None, seed: int, vocab: int):
        self.url, self.model = url, model
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        unlimited = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        # httpx's default 100 connections would cap the batch; $KVGATE_INTERNAL_TOKEN reaches /state and /steps
        self.client = httpx.AsyncClient(timeout=600, limits=unlimited, headers=internal_headers())
        self.pool = Pool(
            connect_timeout=30.0, keepalive_s=UPSTREAM_KEEPALIVE_S
        )  # the completions, as bench serve sends them
        self.index = 0

    def prompt(self, n: int) -> list[int]:
        return self.rng.integers(TOKEN_LOW, self.vocab, n).tolist()

    async def state(self) -> dict:
        return (await self.client.get(self.url + "/state")).json()

    async def mark(self) -> int:
        """The worker's last step number: probes read the steps after it."""
        return (await self.client.get(self.url + "/steps", params={"after": 2**62})).json()["last"]

    async def steps(self, after: int) -> list[StepRecord]:
        """The worker's steps after step `after`."""
        log = (await self.client.get(self.url + "/steps", params={"after": after})).json()["steps"]
        return [StepRecord.from_json(s) for s in log]

    async def one(self, prompt: list[int], max_tokens: int) -> dict:
        self.index += 1
        br = BenchRequest(self.index, 0.0, prompt, max_tokens)
        rec = await send(self.pool, self.url, br, self.model, internal_headers(), True)
        if rec["error"]:
            raise RuntimeError(f"calibration request failed: {rec['error']}")
        return rec

    async def prefill(self, prompt: list[int]) -> dict:
        """One prefill step: its executor ms, uncached and cached tokens, and the client TTFT."""
        mark = await self.mark()
        rec = await self.one(prompt, 1)
        step = (await self.steps(mark))[-1]
        tokens, cached = int(step.work.prefill_tokens), rec["cached_tokens"]
        assert step.work.decode_seqs == 0 and tokens == len(prompt) - cached, "unexpected step: is the worker idle?"
        return {
            "kind": "prefill",
            "key": ("prefill", tokens, cached),
            "ms": step.ms,
            "tokens": tokens,
            "ctx": tokens * (cached + tokens / 2),
            "ttft_ms": rec["ttft_ms"],
        }

    async def until_decoding(self, batch: int, streams: list[asyncio.Task]) -> None:
        """Wait until `batch` requests run and none has prompt left to prefill (or one is done)."""
        while not any(t.done() for t in streams):
            s = await self.state()
            if s["running"] >= batch and s["queued_prefill_tokens"] == 0:
                return
            await asyncio.sleep(0.05)

    async def decode(self, batch: int, prefix: list[int], tokens: int) -> list[dict]:
        """b streams after a cached prefix: the steps where all b decode and the median over
        streams of each one's mean gap (past the first two, which may hold the other streams'
        prefills); and the step where one more request (a quarter of the prefix more) joins them."""
        mark = await self.mark()
        streams = [asyncio.create_task(self.one(prefix + self.prompt(DECODE_SUFFIX), tokens)) for _ in range(batch)]
        await self.until_decoding(batch, streams)
        joined = await self.one(prefix + self.prompt(max(DECODE_SUFFIX, len(prefix) // 4)), 1)
        recs = await asyncio.gather(*streams)
        steps = await self.steps(mark)
        dec = [s for s in steps if s.work.prefill_tokens == 0 and s.work.decode_seqs == batch]
        # Each stream's mean gap (less the step the joining request was in): a client reading many
        # streams at once sees some tokens arrive together (gaps near 0) and the next late, which
        # a median of single gaps takes for the step time; a stream's mean is its step period.
        gaps = [float(np.mean(g)) for r in recs if (g := sorted(r["itl_ms"][2:])[:-1])]
        if not dec or not gaps:
            print(
                f"  {self.url}: no step decoded all {batch} streams at once; batch {batch} not measured "
                f"(more --decode-tokens give large batches time to settle)",
                file=sys.stderr,
                flush=True,
            )
            return []
        out = [
            {
                "kind": "decode",
                "key": ("decode", batch, len(prefix)),
                "batch": batch,
                "kv": float(np.median([s.work.decode_kv_tokens for s in dec])),
                "ms": float(np.median([s.ms for s in dec])),
                "gap_ms": float(np.median(gaps)),
            }
        ]
        cached = joined["cached_tokens"]
        mixed = [
            s
            for s in steps
            if s.work.prefill_tokens == joined["prompt_tokens"] - cached and s.work.decode_seqs == batch
        ]
        if mixed:
            m = mixed[-1]
            n = int(m.work.prefill_tokens)
            out.append(
                {
                    "kind": "mixed",
                    "key": ("mixed", batch, len(prefix)),
                    "batch": batch,
                    "tokens": n,
                    "ctx": n * (cached + n / 2),
                    "kv": m.work.decode_kv_tokens,
                    "ms": m.ms,
                }
            )
        return out

    async def cached_prefill(self, n: int) -> dict:
        base = self.prompt(n)
        await self.one(base, 1)
        return await self.prefill(base + self.prompt(max(16, n // 4)))

    async def round(self, lengths: list[int], batches: list[int], decode_tokens: int) -> list[dict]:
        """Every probe once, the prefill and decode probes interleaved, so that both kinds
        see the same load from whatever else runs on the machine."""
        prefixes = {n: self.prompt(n) for n in (min(lengths), max(lengths))}
        for prefix in prefixes.values():
            await self.one(prefix, 1)
        prefills = [lambda n=n: self.prefill(self.prompt(n)) for n in lengths]
        prefills += [lambda n=n: self.cached_prefill(n) for n in lengths[len(lengths) // 2 :]]
        decodes = [lambda b=b, p=p: self.decode(b, p, decode_tokens) for p in prefixes.values() for b in batches]
        samples = []
        for probe in spread(prefills, decodes):
            got = await probe()
            samples += got if isinstance(got, list) else [got]
        return samples


def spread(*lists: list) -> list:
    """The lists merged with each one's items spread evenly over the result."""
    keyed = [((i + 0.5) / len(items), k, x) for k, items in enumerate(lists) for i, x in enumerate(items)]
    return [x for *_, x in sorted(keyed, key=lambda t: t[:2])]


async def measure(
    url: str,
    model: str | None,
    lengths: list[int],
    batches: list[int],
    decode_tokens: int,
    seed: int,
    vocab: int,
    rounds: int,
) -> list[dict]:
    """`rounds` rounds of every probe, after a first request of each kind to warm the worker up
    (a GPU's first kernel launches are slow; a CPU's first steps cost a few percent more)."""
    p = Probe(url, model, seed, vocab)
    await p.one(p.prompt(max(lengths)), 2)
    await asyncio.gather(*(p.one(p.prompt(DECODE_SUFFIX), 4) for _ in range(max(batches))))
    samples = []
    for r in range(rounds):
        got = await p.round(lengths, batches, decode_tokens)
        samples += got
        longest = max(s["ms"] for s in got if s["kind"] == "prefill")
        decodes = ", ".join(f"b={s['batch']} {s['ms']:.0f} ms" for s in got if s["kind"] == "decode")
        print(
            f"  {url} round {r + 1}/{rounds}: longest prefill {longest:.0f} ms; decode steps {decodes}",
            file=sys.stderr,
            flush=True,
        )
    await p.client.aclose()
    p.pool.close()
    return samples


def medians(samples: list[dict]) -> list[dict]:
    """One sample per probe: the median of each measured value over the rounds (and workers)."""
    groups = defaultdict(list)
    for s in samples:
        groups[s["key"]].append(s)
    return [
        {
            **group[0],
            **{k: float(np.median([g[k] for g in group])) for k in MEASURED if k in group[0]},
            "key": list(key),
            "n": len(group),
        }
        for key, group in groups.items()
    ]


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by dropping the most negative column until none is."""
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[active] = np.linalg.lstsq(a[:, active], y, rcond=None)[0]
        if (x[active] >= 0).all():
            return x
        active.remove(active[int(np.argmin(x[active]))])


def row(s: dict) -> list[float]:
    """The sample's work in CostModel terms: [1, P, sum(P_i * ctx_i) / 1000, D, KV, mixed?]."""
    prefill = s["kind"] != "decode"
    decode = s["kind"] != "prefill"
    return [
        1.0,
        s["tokens"] if prefill else 0.0,
        s["ctx"] / 1000.0 if prefill else 0.0,
        s["batch"] if decode else 0.0,
        s["kv"] if decode else 0.0,
        float(prefill and decode),
    ]


def fit(samples: list[dict]) -> dict:
    """CostModel coefficients and decode table, the per-step engine overhead and the
    per-request overhead, from the probes' medians. Steps that only decode get their own table,
    and its growth per sequence past the largest batch and the cost of a KV token come from its
    larger batches (where a sequence is one more row, not another kernel); the other terms are
    fitted to the steps that prefill, alone or beside decodes."""
    points = medians(samples)
    dec = [s for s in points if s["kind"] == "decode"]
    smallest = min(s["batch"] for s in dec)
    step_overhead = max(0.0, float(np.median([s["gap_ms"] - s["ms"] for s in dec if s["batch"] == smallest])))
    target = np.array([s["gap_ms"] if s["kind"] == "decode" else s["ms"] + step_overhead for s in points])
    a = np.array([row(s) for s in points])
    slope, kv_ms = decode_terms(dec)
    prefills = np.array([s["kind"] != "decode" for s in points])
    free = [i for i, c in enumerate(COLUMNS) if c != "decode_kv_token_ms"]
    y = target[prefills] - kv_ms * a[prefills, COLUMNS.index("decode_kv_token_ms")]
    coef = nnls(a[prefills][:, free] / y[:, None], np.ones(len(y)))
    linear = {**{COLUMNS[i]: float(x) for i, x in zip(free, coef)}, "decode_kv_token_ms": kv_ms}
    cost = CostModel(**linear, decode_batch_ms=decode_table(dec, kv_ms), decode_batch_slope_ms=slope)
    pred = np.array([cost.step_ms(int(r[1]), r[2] * 1000.0, int(r[3]), int(r[4])) for r in a])
    request_overhead = [s["ttft_ms"] - (s["ms"] + step_overhead) for s in points if s["kind"] == "prefill"]
    return {
        **cost.to_json(),
        "step_overhead_ms": step_overhead,
        "request_overhead_ms": max(0.0, float(np.median(request_overhead))),
        "fit_rel_rmse": float(np.sqrt(np.mean(((pred - target) / target) ** 2))),
        "fit": [{"measured_ms": float(t), "fitted_ms": float(f), **s} for s, t, f in zip(points, target, pred)],
    }


def decode_terms(dec: list[dict]) -> tuple[float, float]:
    """Milliseconds per decoding sequence and per KV token it reads: least squares (at least 0)
    over the decode steps of the larger half of the probed batch sizes, at both contexts."""
    sizes = sorted({s["batch"] for s in dec})
    large = [s for s in dec if s["batch"] >= sizes[len(sizes) // 2]]
    a = np.array([[1.0, s["batch"], s["kv"]] for s in large])
    _, seq_ms, kv_ms = nnls(a, np.array([s["gap_ms"] for s in large]))
    return float(seq_ms), float(kv_ms)


def decode_table(dec: list[dict], kv_token_ms: float) -> tuple[float, ...]:
    """A pure decode step's time for b = 1 .. the largest batch probed, less its KV term: the
    median over the probed contexts, linearly interpolated between probed batch sizes (no
    table unless batch 1 was probed: the table starts there)."""
    by_batch = defaultdict(list)
    for s in dec:
        by_batch[s["batch"]].append(s["gap_ms"] - kv_token_ms * s["kv"])
    sizes = sorted(by_batch)
    if sizes[0] != 1:
        return ()
    values = [float(np.median(by_batch[b])) for b in sizes]
    return tuple(float(v) for v in np.interp(np.arange(1, sizes[-1] + 1), sizes, values))


def speed_factors(cost: CostModel, steps: list[StepRecord]) -> tuple[float, float]:
    """(prefill, decode) factors for `cost.scaled` under which the steps that prefill and those
    that do not each take, in all, as long as they did; each step's time is split as `scaled`
    splits it (decoding rows against the rest). Totals, not a fit per step: latency is made of
    sums of steps, and on a busy machine step times are skewed (a step that lost its core
    takes twice as long), which biases a per-step fit low. A profile's step is the executor's
    time plus the engine's own per step, so it is
    compared with the step's wall time, which also holds any wait for a core. A part no step
    exercised keeps factor 1; when the steps cannot tell the parts apart (one kind of step,
    exercising both), one factor serves both."""
    parts = (cost.scaled(1.0, 0.0), cost.scaled(0.0, 1.0))
    rows, totals = [], []
    for group in ([s for s in steps if s.work.prefill_tokens == 0], [s for s in steps if s.work.prefill_tokens > 0]):
        if group:
            rows.append([sum(m.work_ms(s.work) for s in group) for m in parts])
            totals.append(sum(s.wall_ms for s in group))
    used = [j for j in range(2) if any(r[j] for r in rows)]
    if not used:
        return 1.0, 1.0
    if len(rows) < len(used):
        common = sum(totals) / sum(map(sum, rows))
        return common, common
    a = np.array(rows)[:, used]
    solved = nnls(a, np.array(totals))
    factors = [1.0, 1.0]
    for j, x in zip(used, solved):
        factors[j] = float(x)
    return factors[0], factors[1]


def rescale(profile: dict, steps: list[StepRecord]) -> dict:
    """`profile` rescaled to the machine that ran `steps`: its shape (what each kind of work
    costs relative to the others) as the probes measured it, its speed as those steps ran.
    On a machine shared with other jobs a profile measured minutes earlier can be 20% off
    both ways; the steps of real traffic need no probing. The per-request and per-step
    overheads scale by the steps' overall ratio."""
    cost = CostModel.from_json(profile)
    prefill, decode = speed_factors(cost, steps)
    new = cost.scaled(prefill, decode)
    measured = sum(s.wall_ms for s in steps)
    before = sum(cost.work_ms(s.work) for s in steps)
    overall = measured / before if before > 0 else 1.0
    return {
        **profile,
        **new.to_json(),
        "step_overhead_ms": profile.get("step_overhead_ms", 0.0) * overall,
        "request_overhead_ms": profile.get("request_overhead_ms", 0.0) * overall,
        "rescaled": {
            "prefill": prefill,
            "decode": decode,
            "overall": overall,
            "steps": len(steps),
            "at": time.strftime("%Y-%m-%d %H:%M"),
        },
    }


def step_log(url: str, after: int = 0) -> tuple[int, list[StepRecord]]:
    """A worker's last step number and the steps after `after` it still holds (GET /steps)."""
    got = httpx.get(f"{url}/steps", params={"after": after}, timeout=30, headers=internal_headers()).json()
    return got["last"], [StepRecord.from_json(s) for s in got["steps"]]


def plot_fit(profile: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for kind, marker in (("prefill", "o"), ("decode", "s"), ("mixed", "^")):
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


def calibrate(
    urls: list[str], lengths: list[int], batches: list[int], decode_tokens: int = 24, seed: int = 0, rounds: int = 3
) -> dict:
    """Measure the workers at `urls` (at the same time, so a fleet sharing one machine is
    measured under its own contention) and return one profile fitted to all their samples."""
    state = httpx.get(urls[0] + "/state", timeout=10, headers=internal_headers()).json()
    model = state.get("model")
    lengths = [n for n in lengths if n <= state.get("max_batched_tokens", 2048)]

    async def all_workers() -> list[dict]:
        runs = [measure(u, model, lengths, batches, decode_tokens, seed + i, VOCAB, rounds) for i, u in enumerate(urls)]
        return [s for samples in await asyncio.gather(*runs) for s in samples]

    profile = fit(asyncio.run(all_workers()))
    head = {
        "description": f"measured by kvgate calibrate on {', '.join(urls)} ({model}) at "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        "measured": True,
        "model": model,
        "workers": len(urls),
        "block_size": state.get("block_size"),
        "max_batched_tokens": state.get("max_batched_tokens"),
    }
    return {**head, **profile}
