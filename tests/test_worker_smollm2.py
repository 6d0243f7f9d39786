"""Fidelity of the real worker over HTTP: SmolLM2-135M greedy output equals transformers'.

Alone, with 8 concurrent requests, with prefix-cache hits, and with chunked prefill forced
to 7 tokens a step; plus the cached-token report for a shared 200-token prefix.
"""

import concurrent.futures as cf
import random

import httpx
import pytest

from gateway.procs import Worker
from workers.model_store import load_tokenizer, resolve

pytestmark = pytest.mark.slow
MAX_NEW = 12


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def prompts(tok):
    rng = random.Random(3)
    words = "the of cache block model token worker gateway prefix decode prefill route".split()
    texts = [
        "The capital of France is",
        "Write a haiku about paged attention:",
        " ".join(rng.choice(words) for _ in range(110)),
        " ".join(rng.choice(words) for _ in range(240)),
        " ".join(rng.choice(words) for _ in range(560)),
    ]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def reference():
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve("smollm2-135m")), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.eval()

    def generate(ids: list[int]) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
        return out[0, len(ids) :].tolist()

    return generate


@pytest.fixture(scope="module")
def workers():
    ws = [
        Worker(executor="torch", worker_id="fid-a"),
        Worker(executor="torch", worker_id="fid-b", extra=("--max-batched-tokens", "7")),
    ]
    try:
        yield [w.ready() for w in ws]
    finally:
        for w in ws:
            w.kill()


def complete(url: str, ids: list[int]) -> dict:
    r = httpx.post(
        url + "/v1/completions",
        timeout=300,
        json={
            "model": "smollm2-135m",
            "prompt": ids,
            "max_tokens": MAX_NEW,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return {"ids": body["choices"][0]["token_ids"], "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def test_alone_concurrent_cached_and_chunked_match_transformers(workers, prompts, reference):
    expected = [reference(p) for p in prompts]
    a, b = workers
    alone = [complete(a.url, p) for p in prompts]
    assert [r["ids"] for r in alone] == expected
    batch = prompts + prompts[2:]
    with cf.ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda p: complete(a.url, p), batch))
    assert [r["ids"] for r in concurrent] == expected + expected[2:]
    assert all(r["cached"] > 0 for r in concurrent[2:5]), "repeats are served from the prefix cache"
    with cf.ThreadPoolExecutor(8) as pool:
        chunked = list(pool.map(lambda p: complete(b.url, p), batch))
    assert [r["ids"] for r in chunked] == expected + expected[2:]


def test_shared_200_token_prefix_reports_cached_tokens(workers, tok, reference):
    a = workers[0]
    prefix = tok.encode(" ".join(f"fact {i} is that blocks hold sixteen tokens." for i in range(25)))[:200]
    first = prefix + tok.encode(" Question one: what is a block?")
    second = prefix + tok.encode(" Question two: who routes requests?")
    complete(a.url, first)
    r = complete(a.url, second)
    assert r["cached"] >= 192
    assert r["ids"] == reference(second)
