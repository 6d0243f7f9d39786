"""The gateway as users run it: real gateway and sim-worker processes on loopback."""

import json
import random
import time

import httpx
import pytest

from gateway.tokenize import ModelTokenizer
from gateway.procs import Worker, free_port, start_gateway, stop_all, wait_for
from workers.model_store import load_tokenizer

MODEL = "smollm2-135m"
WORDS = (
    "the of cache block model token worker gateway prefix decode prefill route fleet queue "
    "latency memory page hash batch stream chunk event index policy replica"
).split()


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """Everything this module needs, started at once (startup is CPU-bound, so in parallel):
    four sim workers behind prefix_affinity, round_robin and slo_goodput gateways; three more
    behind a round_robin gateway for the tests that kill workers; a gateway with no worker."""
    logs = str(tmp_path_factory.mktemp("gateway"))
    workers = [Worker(worker_id=f"w{i}", log_dir=logs) for i in range(4)]
    doomed = [Worker(worker_id=f"k{i}", log_dir=logs) for i in range(3)]
    urls = [w.url for w in workers]
    gateways = {
        "pa": start_gateway(urls, "prefix_affinity", name="gw-pa", log_dir=logs),
        "rr": start_gateway(urls, "round_robin", name="gw-rr", log_dir=logs),
        "slo": start_gateway(urls, "slo_goodput", name="gw-slo", log_dir=logs),
        "kill": start_gateway([w.url for w in doomed], "round_robin", name="gw-kill", log_dir=logs),
        "dead": start_gateway([f"http://127.0.0.1:{free_port()}"], name="gw-dead", log_dir=logs),
    }
    try:
        for w in workers + doomed:
            w.ready()
        for name, g in gateways.items():
            g.wait_ready("/v1/models")
            if name != "dead":
                n = 3 if name == "kill" else 4
                g.wait_healthy(n, what=f"{name}: {n} workers")
        yield {"workers": workers, "doomed": doomed, **gateways}
    finally:
        stop_all(list(gateways.values()) + workers + doomed)


@pytest.fixture
def fleet(procs):
    return procs


@pytest.fixture(scope="module")
def tokenizer():
    return ModelTokenizer(MODEL, load_tokenizer(MODEL), 16)


def complete(url: str, body: dict, headers: dict | None = None, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, headers=headers, timeout=60)


def sse_events(resp: httpx.Response) -> list[str]:
    """The data of each SSE event of a streaming response."""
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def test_non_streaming_passes_through_with_routing_headers(fleet):
    r = complete(fleet["pa"].url, {"prompt": "The gateway routes", "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvgate-worker"] in {w.worker_id for w in fleet["workers"]}
    assert r.headers["x-kvgate-policy"] == "prefix_affinity"
    assert int(r.headers["x-kvgate-predicted-cached-tokens"]) == 0
    body = r.json()
    assert body["object"] == "text_completion" and body["id"] == r.headers["x-request-id"]
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"


def test_streaming_passes_chat_events_through(fleet):
    body = {
        "messages": [{"role": "user", "content": "Stream me forty tokens"}],
        "max_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", fleet["pa"].url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-kvgate-worker"] and r.headers["x-kvgate-policy"] == "prefix_affinity"
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(d) for d in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 40


def test_streamed_events_reach_the_client_while_the_worker_still_runs(fleet):
    """Unbuffered: the first token reaches the client while the request still runs on its
    worker (400 sim decode steps sleep far longer than one client round trip)."""
    body = {"model": MODEL, "prompt": "Stream me many tokens", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", fleet["pa"].url + "/v1/completions", json=body, timeout=60) as r:
        worker = next(w for w in fleet["workers"] if w.worker_id == r.headers["x-kvgate-worker"])
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert worker.state()["running"] == 1
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"


def test_openai_errors_with_the_right_status(fleet):
    url = fleet["pa"].url
    cases = [
        (httpx.post(url + "/v1/completions", content=b"{not json", timeout=10), 400),
        (httpx.post(url + "/v1/completions", content=b"[1, 2]", timeout=10), 400),
        (complete(url, {"model": "no-such-model", "prompt": "hi"}), 404),
        (complete(url, {"prompt": "hi", "max_tokens": -3}), 400),
        (complete(url, {"prompt": "hi", "temperature": "hot"}), 400),
        (complete(url, {"messages": "not a list"}, path="/v1/chat/completions"), 400),
        (complete(url, {"prompt": "hi"}, headers={"x-slo-ttft-ms": "soon"}), 400),
        (complete(url, {"prompt": "hi", "max_tokens": 100_000}), 400),
        *(
            (complete(url, {"prompt": "hi"}, headers={h: v}), 400)
            for h in ("x-slo-ttft-ms", "x-slo-tpot-ms")
            for v in ("inf", "nan", "1e300", "-5")
        ),
    ]
    for r, status in cases:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and err["type"] and "code" in err
        assert r.headers["x-kvgate-policy"] == "prefix_affinity"
    assert cases[2][0].json()["error"]["code"] == "model_not_found"
    assert cases[7][0].json()["error"]["code"] == "context_length_exceeded"


def test_models_health_and_metrics(fleet):
    url = fleet["pa"].url
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(url + "/health").json()["healthy"] == 4
    complete(url, {"prompt": "count me", "max_tokens": 2})
    metrics = httpx.get(url + "/metrics").text
    for name in (
        "kvgate_gateway_requests_total",
        "kvgate_gateway_decision_seconds_bucket",
        "kvgate_gateway_predicted_cached_tokens_total",
        "kvgate_gateway_actual_cached_tokens_total",
        "kvgate_gateway_time_to_first_token_seconds_bucket",
        "kvgate_gateway_worker_healthy",
    ):
        assert name in metrics
    assert 'status="200"' in metrics and 'status="404"' in metrics


def test_gateway_tokens_and_hashes_are_the_workers(fleet, tokenizer):
    """The gateway's token ids and block hashes for a chat and a text prompt name exactly the
    blocks the worker cached, and its predicted cached tokens equal the worker's report."""
    rng = random.Random(11)
    chat = {
        "messages": [
            {"role": "system", "content": text(rng, 60)},
            {"role": "user", "content": "Ünïcode ✓ and " + text(rng, 80)},
        ],
        "max_tokens": 2,
    }
    plain = {"prompt": text(rng, 150), "max_tokens": 2}
    for body, kind, path in ((chat, "chat", "/v1/chat/completions"), (plain, "completion", "/v1/completions")):
        prep = tokenizer.prepare({"model": MODEL, **body}, kind, 8192)
        first = complete(fleet["pa"].url, body, path=path)
        assert first.json()["usage"]["prompt_tokens"] == len(prep.parsed.prompt_ids)
        worker = next(w for w in fleet["workers"] if w.worker_id == first.headers["x-kvgate-worker"])
        resident = set(worker.internal("/kv/snapshot").json()["hashes"])
        assert len(prep.hashes) >= 8 and set(prep.hashes) <= resident

        def repeat():
            r = complete(fleet["pa"].url, body, path=path)
            return r if int(r.headers["x-kvgate-predicted-cached-tokens"]) else None

        again = wait_for(repeat, timeout=30, interval=0.1, what="residency to reach the gateway")
        assert again.headers["x-kvgate-worker"] == worker.worker_id
        predicted = int(again.headers["x-kvgate-predicted-cached-tokens"])
        assert predicted == again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * len(prep.hashes)


def cached_ratio(url: str, seed: int) -> float:
    """Seven documents behind a short shared preamble, four questions each, asked turn by turn
    (as concurrent readers would): the cached share of all prompt tokens."""
    rng = random.Random(seed)
    preamble = text(rng, 30)
    docs = [text(rng, 300) for _ in range(7)]
    cached = prompt = 0
    for turn in range(4):
        for doc in docs:
            r = complete(url, {"prompt": f"{preamble}\n{doc}\nQ{turn}: {text(rng, 12)}", "max_tokens": 2})
            use = r.json()["usage"]
            cached += use["prompt_tokens_details"]["cached_tokens"]
            prompt += use["prompt_tokens"]
        time.sleep(0.05)
    return cached / prompt


@pytest.mark.slow
def test_prefix_affinity_caches_3x_more_than_round_robin(fleet):
    rr = cached_ratio(fleet["rr"].url, seed=1)
    pa = cached_ratio(fleet["pa"].url, seed=2)
    assert pa >= 0.6 and pa >= 3 * rr, (pa, rr)


def test_client_disconnect_aborts_the_upstream_request(fleet):
    url = fleet["rr"].url
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "never ending", "max_tokens": 5000, "stream": True},
    ) as r:
        worker = next(w for w in fleet["workers"] if w.worker_id == r.headers["x-kvgate-worker"])
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert worker.state()["running"] == 1
    wait_for(lambda: worker.state()["running"] == 0, timeout=30, what="the worker to abort the request")
    # non-streaming: 5000 tokens would take the sim ~20 s; the client gives up after 0.5 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "never ending", "max_tokens": 5000},
            timeout=httpx.Timeout(10, read=0.5),
        )
    wait_for(
        lambda: all(w.state()["running"] == 0 for w in fleet["workers"]),
        timeout=30,
        what="the workers to abort the request",
    )


@pytest.mark.slow
def test_worker_killed_mid_stream_fails_only_that_stream(procs):
    gw, workers = procs["kill"], [w for w in procs["doomed"] if w.alive]
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as c, httpx.Client(timeout=30) as c2:
        with (
            c.stream("POST", gw.url + "/v1/completions", json=body) as doomed,
            c2.stream("POST", gw.url + "/v1/completions", json=body) as other,
        ):
            victim = next(w for w in workers if w.worker_id == doomed.headers["x-kvgate-worker"])
            assert other.headers["x-kvgate-worker"] != victim.worker_id
            doomed_lines, other_lines = doomed.iter_lines(), other.iter_lines()
            next(doomed_lines), next(other_lines)
            victim.kill()
            tail = [line[6:] for line in doomed_lines if line.startswith("data: ")]
            survivor = [line[6:] for line in other_lines if line.startswith("data: ")]
    assert tail[-1] == "[DONE]" and "error" in json.loads(tail[-2])
    assert json.loads(tail[-2])["error"]["code"] == "worker_failed"
    assert survivor[-1] == "[DONE]" and json.loads(survivor[-2])["choices"][0]["finish_reason"] == "length"
    gw.wait_healthy(2, timeout=30, what="the victim to leave")
    for _ in range(6):
        r = httpx.post(gw.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] != victim.worker_id


@pytest.mark.slow
def test_connection_refused_is_retried_on_another_worker(procs):
    """A worker that dies between health polls costs a retry, not an error."""
    gw, victim = procs["kill"], next(w for w in procs["doomed"] if w.alive)
    victim.kill()
    answers = [
        httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        for _ in range(3)
    ]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    assert all(r.headers["x-kvgate-worker"] != victim.worker_id for r in answers)


def test_policy_rejection_is_429_and_no_worker_is_503(procs):
    slo, dead = procs["slo"].url, procs["dead"].url
    r = complete(slo, {"prompt": text(random.Random(0), 400)}, headers={"x-slo-ttft-ms": "0.5"})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert "SLO" in r.json()["error"]["message"] and r.headers["x-kvgate-policy"] == "slo_goodput"
    assert complete(slo, {"prompt": "hi", "max_tokens": 2}, headers={"x-slo-ttft-ms": "10000"}).status_code == 200
    r = complete(dead, {"prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_workers"
    assert httpx.get(dead + "/health").status_code == 503


def test_a_long_prompt_is_tokenized_on_the_loop_when_its_prefix_is_cached(tokenizer, monkeypatch):
    """Past INLINE_CHARS of new text a prompt is tokenized in a thread; a long prompt whose
    prefix an earlier one left cached is tokenized on the event loop (a thread hop cost more
    than the rest), unless its body is past INLINE_MAX_BYTES, cached or not. Either way the
    ids are the tokenizer's."""
    import asyncio

    from gateway import tokenize

    hops = []

    async def in_thread(fn, *args):
        hops.append(fn)
        return fn(*args)

    monkeypatch.setattr(tokenize.asyncio, "to_thread", in_thread)
    doc = " ".join(random.Random(3).choice(WORDS) for _ in range(3000))
    tokenizers = tokenize.Tokenizers(16)

    def prepare(body: dict):
        return asyncio.run(tokenizers.prepare(tokenizer, body, "completion", len(json.dumps(body)), 1 << 20))

    expected = load_tokenizer(MODEL)
    huge = " ".join([doc] * 4)
    cases = ((" first?", 1), (" second?", 1), (" a new " + doc, 2), (huge, 3), (huge + " again", 4))
    for question, thread_hops in cases:
        body = {"model": MODEL, "prompt": doc + question, "max_tokens": 1}
        assert prepare(body).parsed.prompt_ids == expected.encode(body["prompt"])
        assert len(hops) == thread_hops
    assert 4 * tokenize.INLINE_CHARS < len(doc) < tokenize.INLINE_MAX_BYTES < len(huge)


def test_gateway_tokenizer_loads_without_torch_and_matches_auto_tokenizer():
    """The gateway must run without torch: loading the model's tokenizer must not import it
    (transformers' AutoTokenizer does, through the model config), and the generic fast
    tokenizer it loads instead must give AutoTokenizer's ids and chat text."""
    import subprocess
    import sys

    code = (
        "import sys; from workers.model_store import load_tokenizer; load_tokenizer('smollm2-135m'); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    from transformers import AutoTokenizer
    from workers.model_store import resolve

    auto = AutoTokenizer.from_pretrained(str(resolve(MODEL, tokenizer_only=True)))
    ours = load_tokenizer(MODEL)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo <|im_end|> wörld"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    for text in ("plain text", " leading space\nnew line\t tab", "emoji 🎉 and 中文", "<|im_start|>user"):
        assert ours.encode(text) == auto.encode(text)
    assert (ours.eos_token_id, ours.bos_token_id) == (auto.eos_token_id, auto.bos_token_id)
