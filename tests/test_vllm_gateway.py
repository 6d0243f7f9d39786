"""A real gateway in front of a fake vLLM server (tests/fake_vllm.py): residency from its ZMQ
events, load and restarts from its /metrics, health from /health, whole requests forwarded
byte for byte, and no routing decision ever waiting on ZMQ or HTTP."""

import json
import sys
from pathlib import Path

import httpx
import pytest

from tests import vllm_data as vd
from gateway.procs import (
    KVGATE,
    TEST_TOKEN,
    Proc,
    free_port,
    start_gateway,
    start_redis,
    stop_all,
    wait_for,
    wait_redis,
)
from workers.model_store import load_tokenizer

PROMPT = " ".join(f"word{i}" for i in range(60))
PROFILE = Path(__file__).parent.parent / "bench" / "profiles" / "vllm-cpu-smollm2-135m.json"


def start_fake(tmp_path, name: str = "fake-vllm") -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "tests.fake_vllm", "--port", str(port)]
    argv += ["--events-port", str(free_port()), "--replay-port", str(free_port())]
    return Proc(name, argv, port, str(tmp_path))


@pytest.fixture
def fake(tmp_path):
    proc = start_fake(tmp_path)
    try:
        yield proc.wait_ready("/health", 60)
    finally:
        proc.stop()


def control(fake: Proc, **body) -> dict:
    return httpx.post(fake.url + "/_control", json=body, timeout=10).json()


def gateway(fake: Proc, tmp_path, policy: str = "prefix_affinity", extra: tuple = ()) -> Proc:
    tmp_path.mkdir(parents=True, exist_ok=True)
    gw = start_gateway([f"vllm:{fake.url}"], policy, extra=list(extra), log_dir=str(tmp_path))
    gw.wait_ready(timeout=60)
    gw.wait_healthy(1, 30, what="the fake vLLM up")
    return gw


def blocks(n: int) -> list[dict]:
    """BlockStored events for PROMPT's first n engine blocks (32 tokens each), one per batch."""
    ids = load_tokenizer(vd.MODEL).encode(PROMPT)
    assert len(ids) > 32 * n
    return [[vd.stored([100 + i], ids[32 * i : 32 * (i + 1)], parent=100 + i - 1 if i else None)] for i in range(n)]


def predicted(gw: Proc, body: dict | None = None) -> int:
    r = httpx.post(
        gw.url + "/v1/completions", json=body or {"model": vd.MODEL, "prompt": PROMPT, "max_tokens": 1}, timeout=30
    )
    assert r.status_code == 200, r.text
    return int(r.headers["x-kvgate-predicted-cached-tokens"])


def test_residency_follows_the_events_and_a_restart_drops_it_until_resynced(fake, tmp_path):
    gw = gateway(fake, tmp_path, extra=("--internal-token", "fleet-secret"))
    try:
        control(fake, publish=blocks(2))
        wait_for(lambda: predicted(gw) == 64, 30, what="the stored blocks in the index")
        assert gw.metric("kvgate_gateway_resident_blocks") == 4  # 2 vLLM blocks = 4 of the gateway's
        control(fake, restart=True)  # process_start_time_seconds changes, numbering starts again
        wait_for(lambda: predicted(gw) == 0, 30, what="the restarted server's residency dropped")
        control(fake, publish=blocks(1))
        wait_for(lambda: predicted(gw) == 32, 30, what="the new process's events followed")
        assert gw.metric("kvgate_gateway_vllm_event_resyncs_total") >= 2
        assert control(fake)["saw_token"] is False  # the fleet's secret is for kvgate's workers only
    finally:
        gw.stop()


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


def test_an_unhealthy_server_is_out_with_its_residency_and_comes_back_resynced(fake, tmp_path):
    gw = gateway(fake, tmp_path)
    try:
        control(fake, publish=blocks(2))
        wait_for(lambda: predicted(gw) == 64, 30, what="the stored blocks in the index")
        control(fake, health=503)
        gw.wait_healthy(0, 30, what="the server out")
        assert gw.metric("kvgate_gateway_resident_blocks") == 0
        control(fake, health=200)
        gw.wait_healthy(1, 30, what="the server back")
        wait_for(lambda: predicted(gw) == 64, 30, what="its residency replayed")
    finally:
        gw.stop()


def test_no_decision_waits_on_a_replay_that_never_answers(fake, tmp_path):
    control(fake, replay="stuck", publish=blocks(2))
    gw = gateway(fake, tmp_path)
    try:
        for i in range(5):  # routed cache-blind at once while the subscriber waits for its replay
            # (distinct prompts: the router remembers what it just sent, which is not the index)
            assert predicted(gw, {"model": vd.MODEL, "prompt": f"{i} {PROMPT}", "max_tokens": 1}) == 0
        assert gw.metric("kvgate_gateway_vllm_event_batches_total") == 0
        control(fake, replay="ok")
        wait_for(lambda: predicted(gw) == 64, 60, what="the replay once it answers")
    finally:
        gw.stop()


def test_whole_requests_reach_vllm_byte_for_byte(fake, tmp_path):
    gw = gateway(fake, tmp_path)
    try:
        raw = json.dumps(
            {
                "model": vd.MODEL,
                "prompt": ["a b c", "d e"],
                "n": 2,
                "logprobs": 3,
                "max_tokens": 4,
                "presence_penalty": 0.1,
                "vllm_xargs": {"custom": 1},
            }
        ).encode()
        r = httpx.post(gw.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["received"].encode() == raw
    finally:
        gw.stop()


def test_slo_goodput_says_when_a_vllm_worker_has_no_cost_model(fake, tmp_path):
    gw = gateway(fake, tmp_path / "none", "slo_goodput")
    try:
        assert predicted(gw) == 0
        wait_for(lambda: "has no cost model" in gw.log_tail(20_000), 10, what="the warning")
    finally:
        gw.stop()
    gw = gateway(fake, tmp_path / "calibrated", "slo_goodput", ("--vllm-profile", str(PROFILE)))
    try:
        assert predicted(gw) == 0 and "has no cost model" not in gw.log_tail(20_000)
    finally:
        gw.stop()


def test_a_gateway_block_size_that_does_not_divide_vllms_routes_cache_blind_and_says_so(fake, tmp_path):
    gw = gateway(fake, tmp_path, extra=("--block-size", "64"))
    try:
        control(fake, publish=blocks(2))
        wait_for(lambda: gw.metric("kvgate_gateway_vllm_event_batches_total") == 2, 30, what="the batches")
        assert predicted(gw) == 0 and gw.metric("kvgate_gateway_resident_blocks") == 0
        assert "which the gateway's --block-size 64 does not divide" in gw.log_tail(20_000)
    finally:
        gw.stop()


def test_through_a_bridge_a_restart_empties_the_residency_in_redis_until_resynced(fake, tmp_path):
    redis = start_redis(log_dir=str(tmp_path))
    procs = [redis]
    try:
        wait_redis(redis)
        url = f"redis://127.0.0.1:{redis.port}"
        procs.append(
            Proc(
                "bridge",
                KVGATE + ["bridge", "--vllm", fake.url, "--redis", url],
                free_port(),
                str(tmp_path),
                {"KVGATE_INTERNAL_TOKEN": TEST_TOKEN},
            )
        )
        gw = start_gateway([], "prefix_affinity", redis=url, log_dir=str(tmp_path))
        procs.append(gw)
        gw.wait_ready(timeout=60)
        gw.wait_healthy(1, 30, what="the server via redis")
        control(fake, publish=blocks(2))
        wait_for(lambda: predicted(gw) == 64, 30, what="the residency through redis")
        control(fake, restart=True)
        wait_for(lambda: predicted(gw) == 0, 30, what="the restarted server's set emptied")
        control(fake, publish=blocks(1))
        wait_for(lambda: predicted(gw) == 32, 30, what="the new process's events through redis")
        assert gw.metric("kvgate_gateway_vllm_event_batches_total") == 0  # none over ZMQ
    finally:
        stop_all(procs)


# -- /v1/embeddings, /tokenize and /detokenize: forwarded whole to a vLLM worker ---------------

EMBED_KEYS = [{"key": "sk-a", "name": "a"}, {"key": "sk-tokens", "name": "tokens", "tpm": 400}]
BAD_EMBEDDINGS = [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": [1, -1]}, "input"),
    ({"input": [1, 2**63]}, "input"),
    ({"input": [True]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [[1, 2], ["a"]]}, "input"),
    ({"input": [{"role": 1, "content": "hi"}]}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "a", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": True}, "dimensions"),
    ({"input": "a", "dimensions": 1.5}, "dimensions"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "a", "user": 5}, "user"),
    ({"input": "a", "cache_salt": "x" * 300}, "cache_salt"),  # else vLLM would get it, not the tenant's salt
    ({"input": "a", "cache_salt": 7}, "cache_salt"),
    ({"input": "a", "cache_salt": ["a"]}, "cache_salt"),
]


def post_as(gw: Proc, path: str, body: object, key: str = "sk-a") -> httpx.Response:
    return httpx.post(gw.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def test_embeddings_reach_a_vllm_worker_whole_once_their_shape_is_checked(fake, tmp_path):
    (tmp_path / "keys.json").write_text(json.dumps(EMBED_KEYS))
    extra = ("--api-key-file", str(tmp_path / "keys.json"), "--internal-token", "fleet-secret", "--max-retries", "2")
    gw = gateway(fake, tmp_path, extra=extra)
    try:
        body = {
            "model": vd.MODEL,
            "input": ["first text", "second text"],
            "encoding_format": "float",
            "dimensions": 2,
            "user": "u-1",
            "truncate_prompt_tokens": 8,  # vLLM's own fields go through for vLLM to read
            "add_special_tokens": False,
        }
        r = post_as(gw, "/v1/embeddings", body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert [d["index"] for d in got["data"]] == [0, 1] and got["usage"]["prompt_tokens"] == 2
        assert json.loads(got["received"]) == {**body, "cache_salt": "tenant:a"}  # the tenant's salt, as completions
        assert got["request_id"] == r.headers["x-kvgate-request-id"] and got["request_id"].startswith("embd-")
        assert r.headers["x-kvgate-worker"] == f"vllm@127.0.0.1:{fake.port}"
        r = post_as(gw, "/v1/embeddings", {**body, "cache_salt": "tenant:b"})  # a client's own: the tenant's stands
        assert json.loads(r.json()["received"])["cache_salt"] == "tenant:a"
        chat = [{"role": "user", "content": "hi"}]
        for fields in ({"input": "text"}, {"input": [1, 2, 3]}, {"input": [[1, 2], [3]]}, {"input": chat}):
            assert post_as(gw, "/v1/embeddings", {"model": vd.MODEL, **fields}).status_code == 200, fields
        assert post_as(gw, "/v1/embeddings", {"model": vd.MODEL, "messages": [chat, chat]}).status_code == 200

        for fields, param in BAD_EMBEDDINGS:
            r = post_as(gw, "/v1/embeddings", {"model": vd.MODEL, **fields})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
        for field in ("kv_transfer_params", "ec_transfer_params"):  # vLLM's KV and encoder-cache transfers
            r = post_as(gw, "/v1/embeddings", {"model": vd.MODEL, "input": "a", field: {"x": 1}})
            assert r.status_code == 400 and r.json()["error"]["code"] == "internal_field", field
        r = post_as(gw, "/v1/embeddings", {"model": "no-such-model", "input": "a"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

        # a key's tokens per minute count the inputs' tokens: 300 ids pass, 300 more do not
        assert post_as(gw, "/v1/embeddings", {"model": vd.MODEL, "input": [[7] * 300]}, "sk-tokens").status_code == 200
        r = post_as(gw, "/v1/embeddings", {"model": vd.MODEL, "input": [[7] * 150, [7] * 150]}, "sk-tokens")
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        r = post_as(gw, "/v1/embeddings", {"model": vd.MODEL, "input": [7] * 500}, "sk-tokens")
        assert r.status_code == 429 and "500 tokens (inputs) exceed its limit of 400" in r.json()["error"]["message"]

        control(fake, answer=500)  # the worker's failure: the gateway's 502, never vLLM's error
        r = post_as(gw, "/v1/embeddings", {"model": vd.MODEL, "input": "a"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed"
        assert gw.metric("kvgate_gateway_upstream_failures_total", stage="response") == 1
        control(fake, answer=503)  # its load: its answer stands when no other worker is left
        assert post_as(gw, "/v1/embeddings", {"model": vd.MODEL, "input": "a"}).status_code == 503
        failures = gw.metric("kvgate_gateway_upstream_failures_total", stage="response")
        for unserved in (False, 501):  # a generative model's server: no route, or vLLM's 501 on it
            control(fake, answer=200, embeddings=unserved)
            r = post_as(gw, "/v1/embeddings", {"model": vd.MODEL, "input": "a"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
        assert gw.metric("kvgate_gateway_upstream_failures_total", stage="response") == failures  # not the worker's
        assert gw.metric("kvgate_gateway_requests_total") == 0  # the generation series count none of these
        assert control(fake)["saw_token"] is False
    finally:
        gw.stop()


POOLED = [  # vLLM's other pooling endpoints, each with a body of its shape and a bad one
    ("/v2/embed", {"texts": ["a", "b"], "input_type": "search_document"}, {"texts": "a"}, "texts"),
    ("/pooling", {"input": ["a", "b"], "task": "embed"}, {"input": 5}, "input"),
    ("/classify", {"input": "a"}, {"input": []}, "input"),
    ("/score", {"text_1": "q", "text_2": ["a", "b"]}, {"text_1": "q"}, "text_2"),
    ("/v1/score", {"queries": ["q"], "documents": ["a"]}, {"queries": ["q"], "documents": [1]}, "documents"),
    (
        "/rerank",
        {"query": "q", "documents": ["a", "b"], "top_n": 1},
        {"query": "q", "documents": ["a"], "top_n": -1},
        "top_n",
    ),
    (
        "/v1/rerank",
        {"query": "q", "documents": [{"content": [{"type": "text", "text": "a"}]}]},
        {"documents": ["a"]},
        "query",
    ),
    ("/v2/rerank", {"query": "q", "documents": "a"}, {"query": "q", "documents": ["a"] * 2049}, "documents"),
]


def test_the_other_pooling_endpoints_reach_a_vllm_worker_whole_once_their_shape_is_checked(fake, tmp_path):
    keys = [*EMBED_KEYS, {"key": "sk-once", "name": "once", "rpm": 1}]
    (tmp_path / "keys.json").write_text(json.dumps(keys))
    extra = ("--api-key-file", str(tmp_path / "keys.json"), "--internal-token", "fleet-secret")
    gw = gateway(fake, tmp_path, extra=extra)
    try:
        for path, fields, bad, param in POOLED:
            body = {"model": vd.MODEL, **fields, "truncate_prompt_tokens": 8}
            r = post_as(gw, path, body)
            assert r.status_code == 200, (path, r.text)
            got = r.json()
            assert json.loads(got["received"]) == {**body, "cache_salt": "tenant:a"}, path  # whole, the tenant's salt
            assert got["request_id"] == r.headers["x-kvgate-request-id"], path
            assert r.headers["x-kvgate-worker"] == f"vllm@127.0.0.1:{fake.port}"
            r = post_as(gw, path, {"model": vd.MODEL, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
            r = post_as(gw, path, {**body, "kv_transfer_params": {"x": 1}})
            assert r.status_code == 400 and r.json()["error"]["code"] == "internal_field", path
            r = post_as(gw, path, {**body, "cache_salt": "x" * 300})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", path
            r = post_as(gw, path, {k: v for k, v in body.items() if k != "model"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", path
            r = httpx.post(gw.url + path, json=body, timeout=30)  # no key: refused before routing
            assert r.status_code == 401, path
        # a key's request rate counts them: its one request a minute, then 429
        assert (
            post_as(gw, "/rerank", {"model": vd.MODEL, "query": "q", "documents": ["a"]}, "sk-once").status_code == 200
        )
        r = post_as(gw, "/v1/score", {"model": vd.MODEL, "text_1": "q", "text_2": "a"}, "sk-once")
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        # a key's tokens per minute count the pairs: 3 x 150 words of query pass, 3 more do not
        query = " ".join(["word"] * 120)
        rerank = {"model": vd.MODEL, "query": query, "documents": ["a", "b", "c"]}
        assert post_as(gw, "/v1/rerank", rerank, "sk-tokens").status_code == 200
        r = post_as(gw, "/v2/rerank", rerank, "sk-tokens")
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text

        control(fake, answer=500)  # the worker's failure: the gateway's 502, counted against the engine
        r = post_as(gw, "/score", {"model": vd.MODEL, "text_1": "q", "text_2": "a"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed"
        control(fake, answer=200, embeddings=False)  # a generative model's server: no pooling routes
        for path, fields, _, _ in POOLED:
            r = post_as(gw, path, {"model": vd.MODEL, **fields})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "model_not_supported" and path in err["message"], r.text
        assert gw.metric("kvgate_gateway_requests_total") == 0  # the generation series count none of these
        assert control(fake)["saw_token"] is False
    finally:
        gw.stop()


def test_tokenize_reaches_vllm_with_the_fields_only_vllm_reads(fake, tmp_path):
    """vLLM's /tokenize renders `tools` (and a request's chat template, multimodal content)
    that kvgate's own parse refuses: the gateway forwards, so vLLM's answer is the client's."""
    gw = gateway(fake, tmp_path, extra=("--internal-token", "fleet-secret"))
    try:
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
        body = {"model": vd.MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
        r = httpx.post(gw.url + "/tokenize", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [1, 2, 3] and json.loads(r.json()["received"]) == body
        assert r.json()["request_id"] == r.headers["x-kvgate-request-id"]
        r = httpx.post(gw.url + "/detokenize", json={"model": vd.MODEL, "tokens": [1, 2, 3]}, timeout=30)
        assert r.status_code == 200 and r.json()["prompt"] == "abc"
        r = httpx.post(gw.url + "/detokenize", json={"model": vd.MODEL, "tokens": [1], "kv_transfer_params": {}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "internal_field"
        assert control(fake)["saw_token"] is False
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


# -- a worker's answer relayed as it arrives, never held whole -----------------------------------


def test_an_embeddings_answer_is_relayed_as_it_arrives(fake, tmp_path):
    """The client has an answer's first bytes while the worker still holds its last, and a long
    answer whose every piece comes within the idle timeout is whole however long it takes in
    all (the gateway read answers whole, under a total timeout of the idle timeout's length)."""
    gw = gateway(fake, tmp_path, extra=("--upstream-idle-timeout", "4"))
    try:
        control(fake, embeddings_body={"hold": True})
        body = {"model": vd.MODEL, "input": ["a", "b"]}
        with httpx.stream("POST", gw.url + "/v1/embeddings", json=body, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            assert r.headers["x-kvgate-request-id"].startswith("embd-")
            chunks = r.iter_raw()
            first = next(chunks)
            control(fake, release=True)  # the worker sends the rest only now
            got = json.loads(first + b"".join(chunks))
        assert got["released"] == "control" and len(got["data"]) == 2

        control(fake, embeddings_body={"pieces": 8, "gap_s": 0.75, "dims": 4096})  # ~5 s in all
        r = httpx.post(gw.url + "/v1/embeddings", json={"model": vd.MODEL, "input": ["x"] * 16}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        assert [len(d["embedding"]) for d in r.json()["data"]] == [4096] * 16
        assert gw.metric("kvgate_gateway_upstream_failures_total") == 0
    finally:
        gw.stop()


def test_an_answer_broken_off_after_its_head_cuts_the_clients_connection(fake, tmp_path):
    """A relayed answer is committed with its head: a worker that breaks it off costs no retry,
    and the client sees a broken answer, never a short one that reads as whole."""
    gw = gateway(fake, tmp_path)
    try:
        control(fake, embeddings_body={"drop": True, "dims": 1000})
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.post(gw.url + "/v1/embeddings", json={"model": vd.MODEL, "input": ["a", "b"]}, timeout=30)
        assert gw.metric("kvgate_gateway_upstream_failures_total", stage="stream") == 1
        assert gw.metric("kvgate_gateway_retries_total") == 0
    finally:
        gw.stop()


def test_a_model_routed_cache_blind_still_refuses_a_malformed_cache_salt(fake, tmp_path):
    """A model whose tokenizer the gateway cannot load is forwarded whole, for vLLM to check its
    fields; but the cache salt is the tenant's boundary: a malformed one was forwarded in place of
    the tenant's."""
    (tmp_path / "keys.json").write_text(json.dumps(EMBED_KEYS))
    missing = tmp_path / "absent" / vd.MODEL  # the served name, from a folder that is not there
    gw = gateway(fake, tmp_path, extra=("--api-key-file", str(tmp_path / "keys.json"), "--model", str(missing)))
    try:
        body = {"model": vd.MODEL, "prompt": "a b c", "max_tokens": 2}
        r = post_as(gw, "/v1/completions", body)
        assert r.status_code == 200 and r.headers["x-kvgate-predicted-cached-tokens"] == "0", r.text
        for salt in ("x" * 300, 7, ["a"]):
            r = post_as(gw, "/v1/completions", {**body, "cache_salt": salt})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    finally:
        gw.stop()
