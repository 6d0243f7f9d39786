"""kv_prompt_ids: the gateway's tokenization of a request's prompts, used by a worker with the
very same tokenizer instead of tokenizing again (workers/given_ids.py)."""

import copy

import httpx
import pytest

from gateway.procs import Worker, start_gateway, stop_all
from workers.given_ids import FIELD, field_value, fingerprint, given_prompts
from workers.model_store import load_tokenizer
from workers.protocol import parse_request
from workers.sampling_params import InvalidRequest

MODEL = "smollm2-135m"
TOKEN = "given-ids-token"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


class NoEncode:
    """A tokenizer that must not be asked to encode: the ids are given."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, *a, **kw):
        raise AssertionError("tokenized although the ids were given")

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_the_fingerprint_names_the_tokenizer_and_its_chat_template(tok):
    assert fingerprint(tok) == fingerprint(load_tokenizer(MODEL)) and len(fingerprint(tok)) == 32
    other = copy.deepcopy(tok)
    other.chat_template = "{{ messages[0]['content'] }}"
    assert fingerprint(other) != fingerprint(tok)
    assert fingerprint(object()) is None


def test_given_ids_replace_tokenizing_text_and_chat_and_keep_a_clients_own_ids(tok):
    body = {"model": MODEL, "prompt": ["Hello there", [5, 6, 7]], "max_tokens": 4, "echo": True}
    given = [[101, 102, 103], [9, 9]]
    p = parse_request(body, "completion", NoEncode(tok), 512, 49152, given)
    assert p.prompts == [[101, 102, 103], [5, 6, 7]], "a client's token ids are its own"
    assert p.echo_texts[0] == "Hello there", "echo shows the client's text"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(chat, "chat", NoEncode(tok), 512, 49152, [[7, 8]]).prompt_ids == [7, 8]
    same = parse_request(dict(body, echo=False), "completion", tok, 512, 49152)
    assert same.prompts[0] == tok.encode("Hello there"), "without them the worker tokenizes"
    with pytest.raises(InvalidRequest, match="holds 1 prompts"):
        parse_request(body, "completion", NoEncode(tok), 512, 49152, [[1]])
    with pytest.raises(InvalidRequest, match="maximum context length"):
        parse_request(dict(body, prompt="x"), "completion", NoEncode(tok), 16, 49152, [list(range(20))])


def test_only_ids_from_the_same_tokenizer_are_taken_and_they_are_checked(tok):
    fp = fingerprint(tok)
    assert given_prompts(field_value(fp, [[1, 2]]), fp, 100) == [[1, 2]]
    assert given_prompts(field_value("another", [[1, 2]]), fp, 100) is None
    assert given_prompts(field_value(fp, [[1, 2]]), None, 100) is None
    for bad in ([[100]], [[-1]], [[]], [["1"]], [[True]], "ids"):
        with pytest.raises(InvalidRequest):
            given_prompts(field_value(fp, bad), fp, 100)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        given_prompts([[1]], fp, 100)


@pytest.fixture(scope="module")
def fleet():
    w = Worker(worker_id="gi0", extra=["--internal-token", TOKEN])
    g = start_gateway([w.url], "prefix_affinity", name="gw-given", extra=["--internal-token", TOKEN])
    try:
        w.ready()
        g.wait_ready()
        g.wait_healthy(1, what="the worker")
        yield w, g
    finally:
        stop_all([g, w])


def test_through_the_gateway_the_worker_takes_its_ids_and_answers_the_same(fleet):
    w, g = fleet

    def post(url, path, body, headers=None):
        r = httpx.post(url + path, json={"model": MODEL, **body}, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def counts():
        return {by: w.metric("kvgate_worker_prompts_tokenized_total", by=by) for by in ("gateway", "worker")}

    text = {"prompt": "The gateway tokenizes this prompt once, " * 8, "max_tokens": 12, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "Say something about caches."}], "max_tokens": 8}
    before = counts()
    direct = [post(w.url, "/v1/completions", text), post(w.url, "/v1/chat/completions", chat)]
    assert counts() == {"gateway": before["gateway"], "worker": before["worker"] + 2}
    routed = [post(g.url, "/v1/completions", text), post(g.url, "/v1/chat/completions", chat)]
    assert counts() == {"gateway": before["gateway"] + 2, "worker": before["worker"] + 2}
    for a, b in zip(direct, routed):
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert a["choices"][0].get("text") == b["choices"][0].get("text")
        assert a["choices"][0].get("message") == b["choices"][0].get("message")
    post(g.url, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 2})  # ids already: nothing to count
    assert counts()["gateway"] == before["gateway"] + 2


def test_clients_may_not_set_the_field(fleet):
    w, g = fleet
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, FIELD: {"tokenizer": "x", "prompts": [[1]]}}
    r = httpx.post(g.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "internal_field"
    r = httpx.post(w.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["param"] == FIELD


def test_a_worker_without_a_token_ignores_the_ids_and_tokenizes():
    w = Worker(worker_id="gi1")
    try:
        w.ready()
        body = {"model": MODEL, "prompt": "hi there", "max_tokens": 2, FIELD: field_value("x", [[1, 2]])}
        r = httpx.post(w.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(load_tokenizer(MODEL).encode("hi there"))
        assert w.metric("kvgate_worker_prompts_tokenized_total", by="worker") == 1
    finally:
        stop_all([w])
