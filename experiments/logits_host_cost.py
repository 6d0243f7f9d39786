"""Host time of the sampling controls per step (workers/logits_processors.py): what the engine
thread spends in `process_logits` for a batch of penalised rows with long token histories, for a
hostile batch (every row with 1024 logit biases and 1024 min_tokens stop ids), for rows that each
allow 1,000 token ids, and for rows with 16 bad words (of 1 to 4 tokens) each.

The requests are built as the engine builds them (a Request, its output resolved token by
token, its chunk from `chunks_of`), so the script runs against any checkout. On CUDA the call
only queues device work, so its wall time is the host's; the device is synchronised between
calls, outside the timing. On CPU the call includes the tensor work, so a small vocabulary
keeps the host's share in view, and the gathering of the rows' plain data is timed alone too.

    PYTHONPATH=. python experiments/logits_host_cost.py [--device cuda] [--out F.json]
"""

import argparse
import json
import statistics
import time

import torch

from workers import logits_processors
from workers.inflight import PLACEHOLDER, chunks_of
from workers.logits_processors import process_logits
from workers.request import Request
from workers.sampling_params import SamplingParams
from workers.scheduler import StepPlan, resolve


def decoding(rid: str, prompt: list[int], output: list[int], params: SamplingParams) -> Request:
    """A request that has emitted `output`, each token resolved as a step's would be."""
    req = Request(rid, list(prompt), params)
    for t in output:
        req.token_ids.append(PLACEHOLDER)
        req.unresolved += 1
        resolve(req, t)
    req.num_computed = len(req.token_ids) - 1
    return req


def penalised(rows: int, history: int, vocab: int) -> list[Request]:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    out = 64
    return [
        decoding(
            f"p{r}",
            [(r * 7 + i * 13) % vocab for i in range(history - out)],
            [(r + i) % vocab for i in range(out)],
            params,
        )
        for r in range(rows)
    ]


def hostile(rows: int, vocab: int) -> list[Request]:
    ids = range(1024)
    params = SamplingParams(
        max_tokens=4096, min_tokens=4096, stop_token_ids=tuple(ids), logit_bias=tuple((t, 1.0) for t in ids)
    )
    return [decoding(f"h{r}", [1, 2, 3], [4], params) for r in range(rows)]


def allowed(rows: int, ids: int, vocab: int) -> list[Request]:
    params = SamplingParams(allowed_token_ids=tuple(range(vocab - ids, vocab)))
    return [decoding(f"a{r}", [1, 2, 3], [4], params) for r in range(rows)]


def bad_words(rows: int, words: int, vocab: int) -> list[Request]:
    """Rows whose outputs are long enough for every bad word, one of which matches their end."""
    out = [(7 * i) % vocab for i in range(64)]
    sequences = tuple(tuple((w * 31 + k) % vocab for k in range(w % 4 + 1)) for w in range(words - 1))
    params = SamplingParams(bad_words_token_ids=(*sequences, tuple(out[-3:]) + (5,)))
    return [decoding(f"b{r}", [1, 2, 3], out, params) for r in range(rows)]


def host_ms(reqs: list[Request], vocab: int, device: str, steps: int) -> tuple[list[float], list[float]]:
    """Per step, the milliseconds `process_logits` takes on the host, and those its gathering of
    the rows' plain data takes alone (`_gather`: the host's own work on any device)."""
    chunks = chunks_of(StepPlan([(r, 1) for r in reqs]))
    logits = torch.randn(len(chunks), vocab, device=device)
    rows = list(range(len(chunks)))
    times, gathers = [], []
    for _ in range(steps + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        process_logits(logits, chunks, (0,), None)
        t1 = time.perf_counter()
        logits_processors._gather(chunks, rows, (0,))
        times.append((t1 - t0) * 1000)
        gathers.append((time.perf_counter() - t1) * 1000)
    return times[2:], gathers[2:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=0, help="default: 128256 on CUDA, 1024 on CPU")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(1)
    vocab = a.vocab or (128256 if a.device == "cuda" else 1024)
    cases = {
        "penalties 64 x 4k": penalised(64, 4096, vocab),
        "penalties 64 x 32k": penalised(64, 32768, vocab),
        "hostile 256 x (1024 biases + 1024 stop ids)": hostile(256, vocab),
        "allowed_token_ids 64 x 1000 ids": allowed(64, 1000, vocab),
        "bad_words 64 x 16 words": bad_words(64, 16, vocab),
    }
    result = {"device": a.device, "vocab": vocab, "ms": {}}
    for name, reqs in cases.items():
        ms, gather = host_ms(reqs, vocab, a.device, a.steps)
        result["ms"][name] = {"median": statistics.median(ms), "min": min(ms), "gather": statistics.median(gather)}
        print(
            f"{name:45s} median {statistics.median(ms):8.2f} ms  min {min(ms):8.2f} ms"
            f"  (gathering {statistics.median(gather):6.3f} ms)",
            flush=True,
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
