"""vLLM's /tokenize and /detokenize at the gateway, in front of a real sim worker (SmolLM2
tokenizer): forwarded to a worker of the model, so the answer is the worker's own for text and
chat and every prompt option; `model` required and resolved as for completions; internal fields,
oversized bodies, missing keys and a key's request rate refused as for completions; and
/v1/embeddings refused cleanly for a model only kvgate workers serve (they do not embed)."""

import json

import httpx
import pytest

from gateway.procs import Worker, start_gateway, stop_all

MODEL = "smollm2-135m"
CTX = 1024
BODY_CAP = 4096
LONG = "The cache holds the prefix of the prompt, block by block, for the next request. " * 8
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": LONG + "Say it in one line."},
    {"role": "assistant", "content": "The cache keeps"},
]
KEYS = [{"key": "sk-open", "name": "open"}, {"key": "sk-limited", "name": "limited", "rpm": 3}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("gw-tokenize")
    (d / "keys.json").write_text(json.dumps(KEYS))
    logs = str(d)
    w = Worker(worker_id="t0", log_dir=logs, extra=("--max-model-len", str(CTX)))
    gw = start_gateway([w.url], name="gw-tokenize", log_dir=logs)
    keyed = start_gateway(
        [w.url],
        name="gw-tokenize-keys",
        log_dir=logs,
        extra=["--api-key-file", str(d / "keys.json"), "--max-body-bytes", str(BODY_CAP)],
    )
    try:
        w.ready()
        for g in (gw, keyed):
            g.wait_ready("/health")
            g.wait_healthy(1, what="the gateway sees the worker")
        yield {"worker": w.url, "gw": gw, "keyed": keyed.url}
    finally:
        stop_all([gw, keyed, w])


def post(url: str, path: str, body: object, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


TOKENIZE_CASES = {
    "text": {"prompt": LONG},
    "text, no special tokens": {"prompt": LONG, "add_special_tokens": False},
    "text, token strings": {"prompt": "Hello, world!", "return_token_strs": True},
    "chat": {"messages": CHAT[:2]},
    "chat, no generation prompt": {"messages": CHAT[:2], "add_generation_prompt": False},
    "chat, continued": {"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True},
    "chat, special tokens": {"messages": CHAT[:2], "add_special_tokens": True},
}


@pytest.mark.parametrize("fields", TOKENIZE_CASES.values(), ids=TOKENIZE_CASES.keys())
def test_tokenize_at_the_gateway_is_the_workers_own_answer(fleet, fields):
    body = {"model": MODEL, **fields}
    alone, routed = post(fleet["worker"], "/tokenize", body), post(fleet["gw"].url, "/tokenize", body)
    assert alone.status_code == routed.status_code == 200, (alone.text, routed.text)
    assert routed.json() == alone.json()
    assert routed.json()["count"] == len(routed.json()["tokens"]) > 0
    assert routed.json()["max_model_len"] == CTX
    assert routed.headers["x-kvgate-worker"] == "t0"
    assert routed.headers["x-kvgate-request-id"].startswith("tok-")


def test_the_options_change_the_ids_as_they_do_at_the_worker(fleet):
    gw = fleet["gw"].url
    ids = {name: post(gw, "/tokenize", {"model": MODEL, **f}).json()["tokens"] for name, f in TOKENIZE_CASES.items()}
    assert ids["chat"] != ids["chat, no generation prompt"] != ids["chat, continued"]
    strs = post(gw, "/tokenize", {"model": MODEL, **TOKENIZE_CASES["text, token strings"]}).json()["token_strs"]
    assert len(strs) == len(ids["text, token strings"]) and all(isinstance(s, str) for s in strs)


def test_detokenize_at_the_gateway_is_the_workers_own_answer(fleet):
    gw, worker = fleet["gw"].url, fleet["worker"]
    ids = post(gw, "/tokenize", {"model": MODEL, "prompt": LONG}).json()["tokens"]
    body = {"model": MODEL, "tokens": ids}
    alone, routed = post(worker, "/detokenize", body), post(gw, "/detokenize", body)
    assert routed.status_code == 200 and routed.json() == alone.json() == {"prompt": LONG}
    assert routed.headers["x-kvgate-request-id"].startswith("detok-")


BAD = [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT[:2], "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": 1}, "return_token_strs"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "1 2 3"}, "tokens"),
    ("/detokenize", {"tokens": [1] * (CTX + 1)}, "tokens"),
]


@pytest.mark.parametrize("path, fields, param", BAD, ids=[f"{p} {param}" for p, _, param in BAD])
def test_bad_input_is_the_workers_own_400(fleet, path, fields, param):
    body = {"model": MODEL, **fields}
    alone, routed = post(fleet["worker"], path, body), post(fleet["gw"].url, path, body)
    assert openai_error(routed, 400) == openai_error(alone, 400)
    assert routed.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/embeddings"])
def test_the_model_is_required_and_must_be_served(fleet, path):
    gw = fleet["gw"].url
    assert openai_error(post(gw, path, {"prompt": "hi", "tokens": [1], "input": "hi"}), 400)["param"] == "model"
    assert openai_error(post(gw, path, {"model": 5, "prompt": "hi", "tokens": [1]}), 400)["param"] == "model"
    err = openai_error(post(gw, path, {"model": "no-such-model", "prompt": "hi", "tokens": [1], "input": "hi"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert openai_error(post(gw, path, ["not", "an", "object"]), 400)
    r = httpx.post(gw + path, content=b'{"model": "smollm2-135m", "prompt": NaN}', timeout=30)
    assert openai_error(r, 400)


INTERNAL = [
    ("kv_prompt_ids", {"kv_prompt_ids": {"tokenizer": "x", "ids": [[1, 2]]}}),
    ("kv_transfer", {"kv_transfer": {"role": "prefill"}}),
    ("kv_transfer_params", {"kv_transfer_params": {"do_remote_decode": True}}),
    ("ec_transfer_params", {"ec_transfer_params": {"do_remote_encode": True}}),
    ("vllm_xargs", {"vllm_xargs": {"kv_cache_report_mode": "stored"}}),
]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/embeddings"])
@pytest.mark.parametrize("field, fields", INTERNAL, ids=[f for f, _ in INTERNAL])
def test_fields_internal_to_the_fleet_are_refused(fleet, path, field, fields):
    body = {"model": MODEL, "prompt": "hi", "tokens": [1], "input": "hi", **fields}
    err = openai_error(post(fleet["gw"].url, path, body), 400)
    assert err["code"] == "internal_field" and err["param"] == field


def test_a_model_of_kvgate_workers_serves_no_embeddings(fleet):
    for given in ("hello", ["a", "b"], [1, 2, 3]):
        r = post(fleet["gw"].url, "/v1/embeddings", {"model": MODEL, "input": given})
        err = openai_error(r, 400)
        assert err["code"] == "model_not_supported" and err["param"] == "model" and "embeddings" in err["message"]


POOLED = [
    ("/v2/embed", {"texts": ["a"]}),
    ("/pooling", {"input": "a"}),
    ("/classify", {"input": ["a", "b"]}),
    ("/score", {"text_1": "q", "text_2": ["a"]}),
    ("/v1/score", {"queries": "q", "documents": "a"}),
    ("/rerank", {"query": "q", "documents": ["a"]}),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 1}),
    ("/v2/rerank", {"query": "q", "documents": "a"}),
]


@pytest.mark.parametrize("path, fields", POOLED, ids=[p for p, _ in POOLED])
def test_a_model_of_kvgate_workers_serves_no_pooling(fleet, path, fields):
    err = openai_error(post(fleet["gw"].url, path, {"model": MODEL, **fields}), 400)
    assert err["code"] == "model_not_supported" and err["param"] == "model" and path in err["message"]


def test_these_requests_stay_out_of_the_generation_series(fleet):
    gw = fleet["gw"]
    before = gw.metric("kvgate_gateway_requests_total")
    assert post(gw.url, "/tokenize", {"model": MODEL, "prompt": "hi"}).status_code == 200
    assert post(gw.url, "/detokenize", {"model": MODEL, "tokens": [1]}).status_code == 200
    assert gw.metric("kvgate_gateway_requests_total") == before


def test_a_body_past_the_cap_is_a_413(fleet):
    body = {"model": MODEL, "prompt": "x " * BODY_CAP}
    for path in ("/tokenize", "/detokenize", "/v1/embeddings"):
        err = openai_error(post(fleet["keyed"], path, body, "sk-open"), 413)
        assert err["code"] == "request_too_large"
    assert post(fleet["keyed"], "/tokenize", {"model": MODEL, "prompt": "hi"}, "sk-open").status_code == 200


def test_a_keys_rules_apply(fleet):
    """Without a key, a 401; a key's requests per minute count these requests too."""
    url = fleet["keyed"]
    for path in ("/tokenize", "/detokenize", "/v1/embeddings"):
        assert openai_error(post(url, path, {"model": MODEL, "prompt": "hi"}), 401)["code"] == "invalid_api_key"
    assert post(url, "/tokenize", {"model": MODEL, "prompt": "hi"}, "sk-limited").status_code == 200
    assert post(url, "/detokenize", {"model": MODEL, "tokens": [1]}, "sk-limited").status_code == 200
    assert post(url, "/tokenize", {"model": MODEL, "prompt": "hi"}, "sk-limited").status_code == 200
    r = post(url, "/tokenize", {"model": MODEL, "prompt": "hi"}, "sk-limited")
    assert openai_error(r, 429)["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
