"""Whole requests forwarded to a vLLM server (tests/fake_vllm.py behind a real gateway,
tests/fake_vllm_gateway.py): completions byte for byte, /v1/embeddings and vLLM's other pooling
endpoints once their shape is checked, /tokenize and /detokenize with the fields only vLLM
reads, the tenant's cache salt even where the gateway routes cache-blind, and an answer relayed
as it arrives, never held whole."""

import json

import httpx
import pytest

from tests import vllm_data as vd
from tests.fake_vllm_gateway import (
    control,
    fake,  # noqa: F401 (a fixture)
    gateway,
)
from gateway.procs import Proc


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
