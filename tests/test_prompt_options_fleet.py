"""vLLM's prompt options through a gateway sending its ids (`kv_prompt_ids`) to a sim worker:
the worker counts the prompt as it does alone, and each refusal is a 400 naming the field at
the gateway and the worker alike. The cases: tests/prompt_option_cases.py."""

import httpx
import pytest

from gateway.procs import Worker, start_gateway, stop_all
from tests.prompt_option_cases import (
    CHAT_CASES,
    CONVERSATION,
    LONG,
    REFUSED,
    chat_ids,
    tok,  # noqa: F401 (a fixture)
    variant,
)
from workers.model_store import served_name

TOKEN = "prompt-options-token"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A sim worker and a gateway (both with the fleet's token, so the gateway sends its ids,
    `kv_prompt_ids`) serving the BOS-adding, thinking-template tokenizer from its own folder."""
    folder = tmp_path_factory.mktemp("smollm2-options")
    variant().save_pretrained(folder)
    w = Worker(worker_id="po0", model=str(folder), extra=["--internal-token", TOKEN])
    g = start_gateway([w.url], name="gw-options", extra=["--internal-token", TOKEN, "--model", str(folder)])
    try:
        w.ready()
        g.wait_ready()
        g.wait_healthy(1, what="the worker")
        yield w, g, served_name(str(folder))
    finally:
        stop_all([g, w])


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_through_the_gateway_the_worker_counts_the_prompt_as_it_does_alone(fleet, tok):
    w, g, model = fleet
    chat = "/v1/chat/completions"
    cases = [
        ("/v1/completions", {"prompt": LONG, "add_special_tokens": False}, tok.encode(LONG, add_special_tokens=False)),
        *[
            (chat, {"messages": CONVERSATION, **fields}, chat_ids(tok, args, special))
            for fields, args, special in CHAT_CASES.values()
        ],
    ]

    def tokenized(by: str) -> float:
        return w.metric("kvgate_worker_prompts_tokenized_total", by=by)

    for path, fields, want in cases:
        body = {"model": model, "max_tokens": 2, **fields}
        before = tokenized("gateway")
        alone, routed = post(w.url, path, body), post(g.url, path, body)
        assert alone.status_code == routed.status_code == 200, (alone.text, routed.text)
        assert alone.json()["usage"]["prompt_tokens"] == routed.json()["usage"]["prompt_tokens"] == len(want), fields
        assert tokenized("gateway") == before + 1, "the worker took the gateway's ids"
        if path == chat:
            r = post(w.url, "/tokenize", {"model": model, **fields})
            assert r.status_code == 200 and r.json()["tokens"] == want


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"note": "a" * 20000}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"add_special_tokens": "yes"}, "add_special_tokens"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"documents": [{"title": 5}]}, "documents"),
        *[({name: value}, name) for name, value, _ in REFUSED],
    ],
)
def test_refusals_are_400s_naming_the_field_at_the_gateway_and_the_worker(fleet, fields, param):
    w, g, model = fleet
    for url in (g.url, w.url):
        r = post(url, "/v1/chat/completions", {"model": model, "messages": CONVERSATION, "max_tokens": 2, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
