"""P/D between real workers: KV shipped from a prefill worker into a decode worker's cache.

Greedy output through P/D equals a mixed worker's, on SmolLM2 and on a tiny random model;
mismatched transfers are refused; a decode leg whose blocks never come still answers; no
blocks leak on either side.
"""

import concurrent.futures as cf
import time

import httpx
import pytest

from gateway.procs import Worker

pytestmark = pytest.mark.slow


TOKEN = "test-token"


def complete(url, ids, max_tokens=10, **extra):
    headers = {"x-kvgate-token": TOKEN} if "kv_transfer" in extra else None
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(
        url + "/v1/completions",
        timeout=300,
        headers=headers,
        json={
            "model": model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    b = r.json()
    return b["choices"][0]["token_ids"], b["usage"]["prompt_tokens_details"]["cached_tokens"]


def pd(p, d, ids, max_tokens=10):
    """The two legs at once, as the gateway runs them."""
    with cf.ThreadPoolExecutor(2) as pool:
        dec = pool.submit(complete, d.url, ids, max_tokens, kv_transfer={"wait_ms": 20000})
        time.sleep(0.05)
        pool.submit(complete, p.url, ids, 1, kv_transfer={"export_to": d.url}).result()
        return dec.result()


def drained(w):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        s = w.state()
        if s["running"] == s["waiting"] == s["pending_kv"] == 0 and s["free_blocks"] == s["total_blocks"]:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module", params=["smollm2-135m", "tiny"])
def fleet(request, tiny_llama):
    model = "smollm2-135m" if request.param == "smollm2-135m" else str(tiny_llama)
    ws = [
        Worker("torch", f"{request.param}-{role}", extra=("--role", role, "--internal-token", TOKEN), model=model)
        for role in ("prefill", "decode", "mixed")
    ]
    try:
        yield [w.ready() for w in ws]
    finally:
        for w in ws:
            w.kill()


def test_pd_output_equals_mixed_and_decode_reports_cached(fleet):
    p, d, m = fleet
    for n in (40, 130, 301):
        ids = [(i * 37 + n) % 400 + 10 for i in range(n)]
        want, _ = complete(m.url, ids)
        got, cached = pd(p, d, ids)
        assert got == want
        assert cached == (n - 1) // 16 * 16, "the decode leg recomputes at most the last partial block"
    assert drained(p) and drained(d)


def test_decode_leg_without_blocks_falls_back(fleet):
    _, d, m = fleet
    ids = [i % 300 + 5 for i in range(90)]
    want, _ = complete(m.url, ids)
    before = d.metric("kvgate_worker_kv_fallbacks_total")
    got, cached = complete(d.url, ids, 10, kv_transfer={"wait_ms": 300})
    assert got == want and cached == 0
    assert d.metric("kvgate_worker_kv_fallbacks_total") == before + 1, "it waited for blocks, then computed"
    assert drained(d)


def test_import_needs_token_and_matching_spec(fleet):
    p, d, _ = fleet
    assert httpx.post(d.url + "/kv/import", content=b"KVG1").status_code == 403
    r = httpx.post(d.url + "/kv/import", content=b"KVG1\x05\x00\x00\x00{bad}", headers={"x-kvgate-token": TOKEN})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_kv_transfer"
