"""The OpenAI surface as vLLM serves it, through the gateway and on a SmolLM2 worker: logprobs
(chat and completions, whole and streamed, equal to HF's log-softmax), echo, n > 1 sharing the
prompt's cached blocks, prompt lists, GET /v1/models/{id}, stream_options, max_completion_tokens,
/tokenize and /detokenize, JSON 404/405, and the strict types the schema asks for."""

import json
import re

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from gateway.procs import Worker, start_gateway, stop_all
from workers.model_store import load_tokenizer, resolve

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def fleet():
    w = Worker(executor="torch", worker_id="surface", extra=("--num-blocks", "256"))
    procs = [w]
    try:
        w.ready()
        gw = start_gateway([w.url], extra=["--engine-stall-s", "60"])  # a CPU step on a busy machine is no stall
        procs.append(gw)
        gw.wait_ready("/health", 60)
        yield {"worker": w.url, "gateway": gw.url}
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def cached_tokens_total(worker: str) -> float:
    text = httpx.get(worker + "/metrics", timeout=10).text
    return float(re.search(r"^kvgate_worker_cached_tokens_total\{[^}]*\} (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("where", ["gateway", "worker"])
def test_chat_logprobs_whole_and_streamed_agree(fleet, where):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = post(fleet[where], "/v1/chat/completions", body).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 5
    for entry in content:
        assert len(entry["top_logprobs"]) == 2 and entry["token"] == entry["top_logprobs"][0]["token"]
        assert entry["logprob"] == entry["top_logprobs"][0]["logprob"] <= 0
        assert entry["bytes"] == list(entry["token"].encode())
    chunks = stream(fleet[where], "/v1/chat/completions", body)
    streamed = [e for c in chunks for ch in c["choices"] for e in ((ch["logprobs"] or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    # the streamed request reads the prompt's blocks from the cache the first one left, a prefill
    # of another shape: equal to the model's float tolerance (as against HF below), not bit for bit
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=2e-3)


def test_completion_logprobs_equal_hf_log_softmax(fleet, tok):
    prompt = "The capital of France is"
    r = post(
        fleet["gateway"],
        "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 3, "return_token_ids": True},
    )
    choice = r.json()["choices"][0]
    lp, ids = choice["logprobs"], choice["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(resolve(MODEL)), dtype=torch.float32).eval()
    prompt_ids = tok.encode(prompt)
    with torch.inference_mode():
        ref = model(torch.tensor([prompt_ids + ids])).logits[0].log_softmax(-1)
    for step, token in enumerate(ids):
        row = ref[len(prompt_ids) - 1 + step]
        assert lp["token_logprobs"][step] == pytest.approx(row[token].item(), abs=2e-3)
        assert len(lp["top_logprobs"][step]) == 3  # the top 3, the greedy token among them
        assert lp["tokens"][step] == tok.decode([token])
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids))]


def test_echo_starts_the_text_with_the_prompt(fleet):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "echo": True}
    whole = post(fleet["gateway"], "/v1/completions", body).json()["choices"][0]["text"]
    plain = post(fleet["gateway"], "/v1/completions", {**body, "echo": False}).json()["choices"][0]["text"]
    assert whole == "Once upon a time" + plain
    chunks = stream(fleet["gateway"], "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole


def test_n_samples_share_the_prompts_cached_blocks(fleet, tok):
    prompt = " ".join(f"word{i}" for i in range(60))  # > 4 blocks of 16 tokens
    before = cached_tokens_total(fleet["worker"])
    r = post(
        fleet["gateway"],
        "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 4, "n": 4, "temperature": 1.0, "seed": 7, "ignore_eos": True},
    )
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    n_prompt = len(tok.encode(prompt))
    assert body["usage"]["prompt_tokens"] == n_prompt and body["usage"]["completion_tokens"] == 16
    full = n_prompt // 16 * 16
    assert cached_tokens_total(fleet["worker"]) - before >= 3 * min(full, n_prompt - 1) - 3 * 16
    assert len({c["text"] for c in body["choices"]}) > 1, "seeded samples differ (seed + j per sample)"


def test_prompt_lists_and_streamed_choices(fleet):
    body = {
        "model": MODEL,
        "prompt": ["Red is a", "Blue is a"],
        "n": 2,
        "max_tokens": 3,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    chunks = stream(fleet["gateway"], "/v1/completions", body)
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 12
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    whole = post(fleet["gateway"], "/v1/completions", {**body, "stream": False, "stream_options": None}).json()
    assert {c["index"]: c["text"] for c in whole["choices"]} == texts
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the same per prompt


def test_max_completion_tokens_bounds_a_chat(fleet):
    r = post(
        fleet["gateway"],
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_completion_tokens": 2, "ignore_eos": True},
    )
    assert r.json()["usage"]["completion_tokens"] == 2


def test_models_retrieve(fleet):
    for url in fleet.values():
        r = httpx.get(f"{url}/v1/models/{MODEL}", timeout=10)
        assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["object"] == "model"
        missing = httpx.get(f"{url}/v1/models/nope", timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_tokenize_and_detokenize_as_vllm(fleet, tok):
    w = fleet["worker"]
    r = post(w, "/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"]) and r["max_model_len"] > 0
    assert post(w, "/detokenize", {"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = post(w, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    used = post(w, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1}).json()
    assert chat["count"] == used["usage"]["prompt_tokens"]
    assert post(w, "/tokenize", {"prompt": "Hello world"}).json()["tokens"] == r["tokens"]  # model optional, as in vLLM
    assert post(w, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    bad = post(w, "/detokenize", {"model": MODEL, "tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("where", ["gateway", "worker"])
def test_unknown_paths_and_methods_are_json(fleet, where):
    r = httpx.get(fleet[where] + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(fleet[where] + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("where", ["gateway", "worker"])
@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x"}, "model"),
        ({"model": MODEL, "prompt": "x", "stream": "false"}, "stream"),
        ({"model": MODEL, "prompt": "x", "tools": [{"type": "function"}]}, "tools"),
        ({"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
        ({"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs"),
        ({"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ],
)
def test_what_the_schema_refuses(fleet, where, body, param):
    r = post(fleet[where], "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("where", ["gateway", "worker"])
def test_unknown_role_is_refused(fleet, where):
    r = post(fleet[where], "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
