"""A vLLM server that fails (tests/fake_vllm.py behind a real gateway, tests/fake_vllm_gateway.py):
its 5xx is the worker's failure, tried elsewhere and never the client's answer, and its circuit
breaker guards its engine: tokenizations neither open nor close it."""

import httpx

from tests import vllm_data as vd
from tests.fake_vllm_gateway import (
    PROMPT,
    control,
    fake,  # noqa: F401 (a fixture)
    gateway,
    start_fake,
)
from gateway.procs import Proc, start_gateway, stop_all, wait_for


def test_a_server_error_is_the_workers_failure_never_the_clients_answer(fake, tmp_path):
    """A 500 (or 502, 504) is tried elsewhere; with nowhere left the client gets the gateway's
    OpenAI-shaped 502, not the worker's own error. A 503 is load: the worker's answer stands."""
    gw = gateway(fake, tmp_path, extra=("--max-retries", "2", "--breaker-failures", "100"))
    try:
        body = {"model": vd.MODEL, "prompt": PROMPT, "max_tokens": 1}
        for status in (500, 502, 504):
            control(fake, answer=status)
            r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == "worker_failed" and r.json()["error"]["type"] == "server_error"
        assert gw.metric("kvgate_gateway_upstream_failures_total", stage="response") == 3
        control(fake, answer=503)
        assert httpx.post(gw.url + "/v1/completions", json=body, timeout=30).status_code == 503
        control(fake, answer=200)
        assert httpx.post(gw.url + "/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        gw.stop()


def test_a_failing_vllm_worker_costs_a_retry_on_another(fake, tmp_path):
    """Two servers of the model, one failing every request: each request that tries it first
    is retried on the other, and every client gets the healthy one's answer."""
    bad = start_fake(tmp_path, "fake-vllm-bad").wait_ready("/health", 60)
    gw = start_gateway(
        [f"vllm:{fake.url}", f"vllm:{bad.url}"],
        extra=["--breaker-failures", "100", "--max-retries", "2"],
        log_dir=str(tmp_path),
    )
    try:
        gw.wait_ready(timeout=60)
        gw.wait_healthy(2, 30, what="both fake vLLMs up")
        control(bad, answer=500)
        requests = [
            ("/v1/embeddings", {"model": vd.MODEL, "input": "a"}),
            ("/tokenize", {"model": vd.MODEL, "prompt": "a"}),
            ("/detokenize", {"model": vd.MODEL, "tokens": [1]}),
        ] * 8
        for path, body in requests:  # load ties are broken at random: ~half try the bad one first
            r = httpx.post(gw.url + path, json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvgate-worker"] == f"vllm@127.0.0.1:{fake.port}"
        retried = gw.metric("kvgate_gateway_retries_total", stage="response")
        assert retried >= 1 and gw.metric("kvgate_gateway_upstream_failures_total", stage="response") == retried
    finally:
        stop_all([gw, bad])


# -- the circuit breaker guards the engine: tokenizations neither open nor close it ------------

OPENED = "circuit breaker open after"  # the gateway's log line when a breaker opens or reopens


def complete(gw: Proc) -> httpx.Response:
    return httpx.post(gw.url + "/v1/completions", json={"model": vd.MODEL, "prompt": "a", "max_tokens": 1}, timeout=30)


def tokenize(gw: Proc, path: str = "/tokenize") -> httpx.Response:
    return httpx.post(gw.url + path, json={"model": vd.MODEL, "prompt": "a", "tokens": [1]}, timeout=30)


def test_a_server_that_tokenizes_but_fails_every_generation_opens_its_breaker(fake, tmp_path):
    """A tokenization's success says nothing of the engine (it never reset the failures of the
    generations between), and a tokenization's 5xx nothing either (it never opened the breaker
    that keeps generations off the worker)."""
    extra = ("--breaker-failures", "2", "--breaker-cooldown-s", "600", "--max-retries", "0")
    gw = gateway(fake, tmp_path, extra=extra)
    try:
        control(fake, answers={"/tokenize": 500, "/detokenize": 500})
        for path in ("/tokenize", "/detokenize") * 2:
            assert tokenize(gw, path).status_code == 502, path  # the worker's failure: the gateway's 502
        assert complete(gw).status_code == 200  # its engine serves: the breaker stayed closed
        assert OPENED not in gw.log_tail(100_000)

        control(fake, answers={"/v1/completions": 500})  # the engine fails; tokenizing still works
        assert complete(gw).status_code == 502
        assert tokenize(gw).status_code == 200 and tokenize(gw, "/detokenize").status_code == 200
        assert complete(gw).status_code == 502  # the second failure in a row: the breaker opens
        r = complete(gw)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_workers", r.text
        assert tokenize(gw).status_code == 503  # an open breaker keeps tokenizations off it too
        assert gw.log_tail(100_000).count(OPENED) == 1
    finally:
        gw.stop()


def test_a_half_open_breakers_trial_is_a_generations(fake, tmp_path):
    """Once the cooldown is over the breaker lets one request through as its trial: never a
    tokenization, whose success would close it with the engine still failing."""
    gw = gateway(fake, tmp_path, extra=("--breaker-failures", "2", "--breaker-cooldown-s", "1", "--max-retries", "0"))
    try:
        control(fake, answers={"/v1/completions": 500})
        assert [complete(gw).status_code for _ in range(2)] == [502, 502]  # opens
        wait_for(lambda: gw.healthy() == 1, 30, what="the breaker half-open after its cooldown")
        for path in ("/tokenize", "/detokenize"):
            r = tokenize(gw, path)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_workers", (path, r.text)
        assert complete(gw).status_code == 502  # the trial: it fails, and the breaker reopens
        assert gw.log_tail(100_000).count(OPENED) == 2
    finally:
        gw.stop()
