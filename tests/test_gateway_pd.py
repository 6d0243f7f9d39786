"""P/D through the gateway: one ordinary stream to the client, two legs behind it.

Real torch workers (a tiny random Llama) as prefill, decode and a mixed reference; the gateway
runs slo_goodput with a low disaggregation threshold.
"""

import json

import httpx
import pytest

from gateway.procs import Worker, start_gateway, stop_all, wait_for

pytestmark = pytest.mark.slow
SECRET = ("--internal-token", "gw-pd-token")


@pytest.fixture(scope="module")
def pd_fleet(tiny_llama, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pd"))
    model = str(tiny_llama)
    p = Worker("torch", "pd-p", extra=("--role", "prefill", *SECRET), model=model, log_dir=logs)
    d = Worker("torch", "pd-d", extra=("--role", "decode", *SECRET), model=model, log_dir=logs)
    m = Worker("torch", "pd-m", extra=SECRET, model=model, log_dir=logs)
    gw = start_gateway(
        [p.url, d.url],
        "slo_goodput",
        log_dir=logs,
        extra=[
            *SECRET,
            "--model",
            model,
            "--pd-min-uncached-tokens",
            "64",
            "--slo-ttft-ms",
            "60000",
            "--slo-tpot-ms",
            "60000",
        ],
    )
    try:
        for w in (p, d, m):
            w.ready()
        gw.wait_ready("/v1/models")
        gw.wait_healthy(2, what="2 workers")
        yield {"p": p, "d": d, "m": m, "gw": gw, "model": tiny_llama.name}
    finally:
        stop_all([gw, p, d, m])


def ask(url, model, ids, stream=False, max_tokens=8, **extra):
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        **extra,
    }
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        b = r.json()
        return r.headers, b["choices"][0]["token_ids"], b["usage"]["prompt_tokens_details"]["cached_tokens"]
    ids_out, cached = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        headers = r.headers
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                for c in ev["choices"]:
                    ids_out += c.get("token_ids", [])
                if ev.get("usage"):
                    cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
    return headers, ids_out, cached


def prompt(n, salt):
    return [(i * 31 + salt) % 3000 + 100 for i in range(n)]


def test_long_prompt_is_disaggregated_and_matches_a_mixed_worker(pd_fleet):
    f = pd_fleet
    for n, stream in ((200, False), (333, True)):
        ids = prompt(n, n)
        _, want, _ = ask(f["m"].url, f["model"], ids)
        headers, got, cached = ask(f["gw"].url, f["model"], ids, stream=stream)
        assert headers["x-kvgate-prefill-worker"] == "pd-p" and headers["x-kvgate-worker"] == "pd-d"
        assert got == want
        assert cached == (n - 1) // 16 * 16, "the decode worker admitted it as a prefix hit"


def test_min_tokens_stays_on_the_decode_leg(pd_fleet):
    """A client's min_tokens above the prefill leg's one token: the prefill worker still serves
    its leg and ships the blocks, so the decode worker admits the prompt as a prefix hit (a
    refused leg had left it to wait out its kv wait and recompute the prompt)."""
    f = pd_fleet
    n = 230
    ids = prompt(n, 3)
    headers, got, cached = ask(f["gw"].url, f["model"], ids, min_tokens=6, logit_bias={"7": -5}, stop=["zz"])
    assert headers["x-kvgate-prefill-worker"] == "pd-p" and headers["x-kvgate-worker"] == "pd-d"
    assert len(got) == 8
    assert cached == (n - 1) // 16 * 16, "the decode worker imported the prompt's blocks"


def test_a_request_for_two_sequences_stays_on_one_worker(pd_fleet):
    """n=2 asks for two sequences, which one KV handoff cannot carry: served whole by one
    worker, not refused for a field the client never sent."""
    f = pd_fleet
    body = {"model": f["model"], "prompt": prompt(200, 11), "max_tokens": 4, "n": 2, "ignore_eos": True}
    r = httpx.post(f["gw"].url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and "x-kvgate-prefill-worker" not in r.headers


def test_short_uncached_part_stays_on_the_decode_worker(pd_fleet):
    f = pd_fleet
    ids = prompt(40, 7)
    headers, got, _ = ask(f["gw"].url, f["model"], ids)
    assert "x-kvgate-prefill-worker" not in headers and headers["x-kvgate-worker"] == "pd-d"
    assert got == ask(f["m"].url, f["model"], ids)[1]


def test_no_blocks_leak_on_either_side(pd_fleet):
    f = pd_fleet
    for w in (f["p"], f["d"]):
        wait_for(
            lambda: (
                lambda s: s["running"] == s["waiting"] == s["pending_kv"] == 0 and s["free_blocks"] == s["total_blocks"]
            )(w.state()),
            what=f"{w.name} drained",
        )
    metrics = httpx.get(f["gw"].url + "/metrics").text
    assert f'kvgate_gateway_prefill_legs_total{{model="{f["model"]}",outcome="ok",worker="pd-p"}}' in metrics


def test_routing_quality_counts_each_leg_of_a_pd_request(pd_fleet):
    """A P/D request's decode leg is expected to find every full block but the last cached (its
    prefill leg ships them) and does; the prefill leg is judged on its own worker."""
    f = pd_fleet
    ask(f["gw"].url, f["model"], prompt(300, 11))
    text = httpx.get(f["gw"].url + "/metrics").text

    def counted(name: str, worker: str, leg: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(f"kvgate_gateway_{name}_total{{")
            and f'worker="{worker}"' in line
            and f'leg="{leg}"' in line
        )

    prompt_tokens, predicted, actual = (
        counted(n, "pd-d", "decode") for n in ("prompt_tokens", "predicted_cached_tokens", "actual_cached_tokens")
    )
    assert prompt_tokens >= 300 and predicted == actual > 0.9 * prompt_tokens
    assert counted("prompt_tokens", "pd-p", "prefill") >= 300
