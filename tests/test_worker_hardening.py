"""A worker against hostile input and faults, on real worker processes (sim executor).

Request ids from clients never key the engine; `kv_transfer` needs the internal token; a step
that raises fails its requests cleanly and the engine goes on; a dead or frozen engine shows in
/health and /state; the advertised context is what the pool holds; P/D roles need a token;
SIGTERM drains; the waiting queue is bounded.
"""

import concurrent.futures as cf
import json
import signal
import socket

import httpx
import pytest

from bench import fault_worker as fw
from gateway.procs import Proc, Worker, free_port, start_gateway, stop_all, wait_for

MODEL = "smollm2-135m"
TOKEN = "hardening-token"


def start_fault_worker(name: str, extra: tuple[str, ...] = ()) -> Proc:
    return fw.start(name, MODEL, extra=extra).wait_ready(timeout=180)


def slow_profile(tmp_path, base_ms: float = 20.0) -> str:
    """A sim cost model whose every step takes at least `base_ms`: requests last long enough to
    be caught in flight."""
    path = tmp_path / "slow.json"
    path.write_text(json.dumps({"base_ms": base_ms}))
    return str(path)


def complete(
    url: str, ids: list[int], max_tokens: int = 8, headers: dict | None = None, timeout: float = 30, **extra
) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        headers=headers,
        timeout=timeout,
        json={
            "model": MODEL,
            "prompt": ids,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        },
    )


def token_ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def sse_events(lines) -> list:
    """The JSON events of an SSE stream, then "[DONE]" if it came."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


@pytest.fixture(scope="module")
def worker():
    w = Worker(worker_id="hard", extra=("--num-blocks", "256", "--internal-token", TOKEN))
    try:
        yield w.ready()
    finally:
        w.kill()


def test_same_request_id_at_once_keeps_requests_apart(worker):
    """Two requests sharing an x-request-id each get their own tokens, and the engine goes on."""
    a, b = [10 + i for i in range(40)], [500 + 3 * i for i in range(40)]
    want_a, want_b = token_ids(complete(worker.url, a, 100)), token_ids(complete(worker.url, b, 100))
    assert want_a != want_b
    dup = {"x-request-id": "same-id"}
    with cf.ThreadPoolExecutor(2) as pool:
        fa = pool.submit(complete, worker.url, a, 100, dup)
        fb = pool.submit(complete, worker.url, b, 100, dup)
        ra, rb = fa.result(), fb.result()
    assert token_ids(ra) == want_a and token_ids(rb) == want_b
    assert ra.headers["x-request-id"] == rb.headers["x-request-id"] == "same-id"
    assert token_ids(complete(worker.url, a, 5)) == want_a[:5]
    s = worker.state()
    assert s["running"] == s["waiting"] == 0


def test_kv_transfer_needs_the_internal_token(worker):
    """A client cannot make the worker POST to a URL of its choosing, nor hold a request."""
    trap = socket.socket()
    trap.bind(("127.0.0.1", free_port()))
    trap.listen()
    trap.settimeout(1.0)
    try:
        url = f"http://127.0.0.1:{trap.getsockname()[1]}"
        ids = list(range(100, 164))
        for kv, headers in (
            ({"export_to": url}, None),
            ({"export_to": url}, {"x-kvgate-token": "wrong"}),
            ({"wait_ms": 60000}, None),
        ):
            err = assert_error(complete(worker.url, ids, 1, headers, kv_transfer=kv), 403)
            assert err["type"] == "permission_error"
        with pytest.raises(socket.timeout):
            trap.accept()
    finally:
        trap.close()
    before = worker.metric("kvgate_worker_kv_fallbacks_total")
    r = complete(worker.url, ids, 2, {"x-kvgate-token": TOKEN}, kv_transfer={"wait_ms": 50})
    assert token_ids(r)
    assert worker.metric("kvgate_worker_kv_fallbacks_total") == before + 1, "it waited for blocks, then computed"


def test_a_worker_without_token_refuses_kv_transfer():
    w = Worker(worker_id="notoken", extra=("--num-blocks", "64")).ready()
    try:
        assert_error(complete(w.url, [5, 6, 7], 1, kv_transfer={"wait_ms": 10}), 403)
        assert_error(complete(w.url, [5, 6, 7], 1, {"x-kvgate-token": ""}, kv_transfer={"wait_ms": 10}), 403)
        assert token_ids(complete(w.url, [5, 6, 7], 1))
    finally:
        w.kill()


def test_advertised_context_is_what_the_pool_holds():
    """64 blocks of 16 hold 1,024 tokens: that is the context. As vLLM 0.32 does, a budget past
    what the prompt leaves of it stops at the context (finish "length"); a budget past the whole
    context, or a prompt that leaves no room, is a 400."""
    w = Worker(worker_id="small", extra=("--num-blocks", "64")).ready()
    try:
        models = httpx.get(w.url + "/v1/models").json()["data"]
        assert models[0]["max_model_len"] == 1024
        assert w.state()["max_model_len"] == 1024
        prompt = [100 + i % 900 for i in range(1000)]
        for budget in (24, 100):
            r = complete(w.url, prompt, budget)
            assert len(token_ids(r)) == 24 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert_error(complete(w.url, prompt, 1025), 400, "context_length_exceeded")
        assert_error(complete(w.url, prompt + list(range(24)), 1), 400, "context_length_exceeded")
    finally:
        w.kill()


def test_prefill_or_decode_worker_without_token_will_not_start(monkeypatch):
    monkeypatch.delenv("KVGATE_INTERNAL_TOKEN", raising=False)
    w = Worker(worker_id="pd-notoken", extra=("--role", "prefill"))
    try:
        assert w.popen.wait(timeout=120) != 0
        assert "--internal-token" in w.log_tail()
    finally:
        w.kill()


@pytest.fixture(scope="module")
def faulty():
    w = start_fault_worker("faulty", ("--stall-timeout-s", "1"))
    try:
        yield w
    finally:
        w.kill()


def test_step_that_raises_fails_its_requests_and_the_engine_goes_on(faulty):
    err = assert_error(complete(faulty.url, [fw.RAISE, 11, 12, 13], 4), 500, "engine_error")
    assert err["type"] == "server_error"
    with httpx.stream(
        "POST",
        faulty.url + "/v1/completions",
        timeout=30,
        json={"model": MODEL, "prompt": [fw.RAISE, 21, 22], "max_tokens": 4, "stream": True},
    ) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
    for _ in range(3):
        assert len(token_ids(complete(faulty.url, [31, 32, 33], 4))) == 4
    assert httpx.get(faulty.url + "/health").status_code == 200
    s = faulty.state()
    assert s["engine_alive"] is True and s["running"] == s["waiting"] == 0
    assert s["free_blocks"] == s["total_blocks"]
    assert "kvgate_worker_requests_failed_total" in httpx.get(faulty.url + "/metrics").text


def test_frozen_engine_shows_a_stall(faulty):
    with cf.ThreadPoolExecutor(1) as pool:
        frozen = pool.submit(complete, faulty.url, [fw.FREEZE, 41, 42], 2)
        wait_for(
            lambda: faulty.state()["engine_stall_s"] > 1.0, timeout=fw.FREEZE_S * 3, what="engine_stall_s to pass 1 s"
        )
        h = wait_for(
            lambda: (lambda r: r if r.status_code == 503 else None)(httpx.get(faulty.url + "/health")),
            timeout=fw.FREEZE_S * 3,
            what="/health to answer 503",
        )
        assert_error(h, 503, "engine_stalled")
        assert len(token_ids(frozen.result())) == 2
    wait_for(lambda: httpx.get(faulty.url + "/health").status_code == 200, what="/health back to 200")
    assert faulty.state()["engine_stall_s"] == 0.0


def test_dead_engine_answers_and_shows():
    w = start_fault_worker("dying")
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            running = pool.submit(complete, w.url, [50, 51, 52], 2000)
            wait_for(lambda: w.state()["running"] == 1, what="a running request")
            r = complete(w.url, [fw.DIE, 1, 2], 2)
            assert r.status_code >= 500 and r.json()["error"]["type"] == "server_error"
            assert running.result().status_code >= 500
        assert_error(httpx.get(w.url + "/health"), 503, "engine_stopped")
        assert w.state()["engine_alive"] is False
        assert_error(complete(w.url, [5, 6], 2), 503, "engine_stopped")
    finally:
        w.kill()


def test_sigterm_drains(tmp_path):
    """In-flight requests finish; new ones get 503 + Retry-After; then the worker exits."""
    w = Worker(worker_id="drain", extra=("--sim-profile", slow_profile(tmp_path))).ready()
    try:
        with httpx.stream(
            "POST",
            w.url + "/v1/completions",
            timeout=60,
            json={
                "model": MODEL,
                "prompt": [7, 8, 9],
                "max_tokens": 60,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            },
        ) as stream:
            lines = stream.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            w.signal(signal.SIGTERM)
            wait_for(lambda: w.state()["draining"], what="draining")
            r = complete(w.url, [1, 2, 3], 2)
            assert_error(r, 503, "draining")
            assert int(r.headers["retry-after"]) >= 1
            assert_error(httpx.get(w.url + "/health"), 503, "draining")
            events = sse_events([first, *lines])
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 60
        assert w.popen.wait(timeout=30) == 0
    finally:
        w.kill()


def test_waiting_queue_is_bounded(tmp_path):
    w = Worker(
        worker_id="bounded",
        extra=("--max-num-seqs", "1", "--max-queued-requests", "1", "--sim-profile", slow_profile(tmp_path)),
    ).ready()
    body = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=60) as client, cf.ThreadPoolExecutor(1) as pool:
            with client.stream("POST", w.url + "/v1/completions", json=body) as running:
                lines = running.iter_lines()  # kept: a dropped iterator closes the stream
                next(ln for ln in lines if ln.startswith("data: "))
                queued = pool.submit(complete, w.url, [4, 5, 6], 3)
                wait_for(lambda: w.state()["waiting"] == 1, what="a waiting request")
                r = complete(w.url, [1, 2, 3], 2)
                assert_error(r, 503, "overloaded")
                assert int(r.headers["retry-after"]) >= 1
            assert len(token_ids(queued.result())) == 3
        assert len(token_ids(complete(w.url, [1, 2, 3], 2))) == 2
    finally:
        w.kill()


def test_gateway_pd_legs_carry_the_internal_token():
    """P/D between sim workers through a gateway given the fleet's token; a client's own
    kv_transfer is never honoured."""
    secret = ("--internal-token", TOKEN)
    p = Worker(worker_id="hp", extra=("--role", "prefill", *secret))
    d = Worker(worker_id="hd", extra=("--role", "decode", *secret))
    gw = start_gateway(
        [p.url, d.url],
        "slo_goodput",
        extra=[*secret, "--pd-min-uncached-tokens", "64", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000"],
    )
    try:
        p.ready(), d.ready()
        gw.wait_ready("/v1/models")
        gw.wait_healthy(2, what="2 workers")
        ids = [(i * 31) % 3000 + 100 for i in range(300)]
        r = complete(gw.url, ids, 4, timeout=60)
        assert len(token_ids(r)) == 4 and r.headers["x-kvgate-prefill-worker"] == "hp"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 299 // 16 * 16
        r = complete(gw.url, ids[:100], 1, kv_transfer={"export_to": "http://127.0.0.1:9"})
        assert r.status_code in (400, 403), r.text
    finally:
        stop_all([gw, p, d])


def test_gateway_without_the_fleets_token_is_refused_and_says_why():
    """Workers with a token refuse a gateway without it (their state and residency are internal),
    so it never routes to them, answers 503, and its log names the missing flag."""
    secret = ("--internal-token", TOKEN)
    p = Worker(worker_id="np", extra=("--role", "prefill", *secret))
    d = Worker(worker_id="nd", extra=("--role", "decode", *secret))
    gw = start_gateway([p.url, d.url], "slo_goodput")
    try:
        p.ready(), d.ready()
        gw.wait_ready("/v1/models")
        wait_for(lambda: "--internal-token" in gw.log_tail(), what="the gateway to say why")
        health = httpx.get(gw.url + "/health")
        assert health.status_code == 503 and health.json()["healthy"] == 0
        assert_error(complete(gw.url, [5, 6, 7], 2), 503)
    finally:
        stop_all([gw, p, d])


def test_torch_sampling_fault_fails_one_request_not_the_engine(tiny_llama):
    """A top_k the sampler cannot take (valid JSON, 10**309) used to stop a torch engine for
    good; now it is refused up front or fails alone, and the worker serves on."""
    w = Worker("torch", "torch-topk", model=str(tiny_llama), extra=("--num-blocks", "64")).ready()
    model = tiny_llama.name
    try:
        r = httpx.post(
            w.url + "/v1/completions",
            timeout=60,
            json={"model": model, "prompt": [5, 6, 7], "max_tokens": 2, "top_k": 10**309},
        )
        assert r.status_code in (400, 500), r.text
        assert r.json()["error"]["type"] in ("invalid_request_error", "server_error")
        r = httpx.post(
            w.url + "/v1/completions",
            timeout=60,
            json={"model": model, "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        w.kill()
