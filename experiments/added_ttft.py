"""What the gateway adds to TTFT, measured quietly: one sim worker (the h200-llama8b eager
profile) and a gateway in front of it; sequential streaming requests of 256-token text prompts
(`--prompts words`: vocabulary words as `bench.prompt_text` writes them, what `bench.vs_peers`
sends; `ids`: random ids decoded, word fragments), alternating straight to the worker and
through the gateway, `--rounds` x `--n` each.
Sequential and one worker, so the figure is the gateway's path (tokenize, route, one more
HTTP hop) rather than the queueing noise of a loaded 2-core host.

    python experiments/added_ttft.py [--rounds 3] [--n 20] [--prompts words|ids]
"""

import argparse
import time

import httpx
import numpy as np

from bench.prompt_text import as_text
from gateway.procs import Worker, start_gateway, stop_all, wait_for
from workers.model_store import load_tokenizer

TOKEN = "added-ttft"


def ttft_ms(client: httpx.Client, url: str, prompt: str) -> float:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 4, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    assert first is not None, "the stream carried no token"
    return 1000.0 * first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--prompts", choices=("words", "ids"), default="words")
    args = p.parse_args()
    tok, rng = load_tokenizer("smollm2-135m"), np.random.default_rng(0)
    write = as_text(tok) if args.prompts == "words" else tok.decode
    profile = ["--sim-profile", "bench/profiles/h200-llama8b-kvgate-eager.json"]
    w = Worker(worker_id="t0", extra=["--internal-token", TOKEN, *profile])
    g = start_gateway([w.url], "prefix_affinity", extra=["--internal-token", TOKEN])
    try:
        w.ready()
        g.wait_ready()
        wait_for(lambda: httpx.get(g.url + "/health").json()["healthy"] == 1, what="the worker")
        got: dict[str, list[float]] = {"direct": [], "gateway": []}
        with httpx.Client(timeout=30) as client:
            for _ in range(args.rounds):
                for name, url in (("direct", w.url), ("gateway", g.url)):
                    for _ in range(args.n):
                        prompt = write(rng.integers(100, 40000, 256).tolist())
                        got[name].append(ttft_ms(client, url, prompt))
                        time.sleep(0.05)
        q = {k: (float(np.percentile(v, 50)), float(np.percentile(v, 90))) for k, v in got.items()}
        for k, (p50, p90) in q.items():
            print(f"{k}: TTFT p50 {p50:.2f} ms, p90 {p90:.2f} ms")
        print(f"added: p50 {q['gateway'][0] - q['direct'][0]:+.2f} ms, p90 {q['gateway'][1] - q['direct'][1]:+.2f} ms")
    finally:
        stop_all([g, w])


if __name__ == "__main__":
    main()
