"""vLLM's body `request_id`: checked by the one rule a client's id is held to (workers/protocol.py's
CLIENT_ID, the x-request-id header's too) at the worker and the gateway alike, shown as vLLM shows
it (behind `cmpl-`/`chatcmpl-`, an `x-request-id` header ahead of it), and never an engine key:
requests sharing one run apart. Worker tests run in-process (sim executor, SmolLM2 tokenizer)."""

import asyncio
import json
import threading

import pytest

from gateway.passthrough import parse_whole
from gateway.tokenize import ModelTokenizer
from tests.asgi_worker import GUARD_S, MODEL, Call, error_of, server, settled, until  # noqa: F401
from workers.model_store import load_tokenizer
from workers.protocol import check_request, parse_request
from workers.sampling_params import InvalidRequest

PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
BAD = [5, True, "", "two words", "line\nbreak", "café", "x" * 129, ["r"], {"id": "r"}]
GOOD = ["req-1", "x" * 128, "0f3c9e1a-8d4b-4c4e-9a56-1d2e3f4a5b6c", "a/b:c=d"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def body(kind: str, prompt: str = "hi", **extra) -> dict:
    base = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True, **extra}
    if kind == "chat":
        return {**base, "messages": [{"role": "user", "content": prompt}]}
    return {**base, "prompt": prompt}


def parses(tok) -> list:
    """Every parse a client's body meets: the worker's, the gateway's (its own workers, a vLLM
    fleet's whole forward, a gateway without a tokenizer)."""
    gw = ModelTokenizer(MODEL, tok, 16)
    return [
        lambda b, kind: parse_request(b, kind, tok, 1024),
        lambda b, kind: gw.prepare(b, kind, 1024),
        lambda b, kind: parse_whole(b, kind, tok, 1024),
        check_request,
    ]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("value", BAD)
def test_a_bad_request_id_is_a_400_naming_it_wherever_parsed(tok, kind, value):
    for parse in parses(tok):
        with pytest.raises(InvalidRequest) as e:
            parse(body(kind, request_id=value), kind)
        assert e.value.param == "request_id" and e.value.code == "invalid_request"


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("value", GOOD)
def test_a_sound_request_id_is_taken_wherever_parsed_and_changes_no_prompt(tok, kind, value):
    for parse in parses(tok):
        parse(body(kind, request_id=value), kind)
    parsed = parse_request(body(kind, request_id=value), kind, tok, 1024)
    assert parsed.client_request_id == value
    assert parsed.prompt_ids == parse_request(body(kind), kind, tok, 1024).prompt_ids
    assert parse_request(body(kind, request_id=None), kind, tok, 1024).client_request_id is None


def events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "kind,headers,request_id,shown",
    [
        ("completion", {}, "req-1", "cmpl-req-1"),
        ("chat", {}, "req-1", "chatcmpl-req-1"),
        ("completion", {"x-request-id": "hdr-1"}, "req-1", "hdr-1"),  # vLLM: the header first
        ("chat", {"x-request-id": "two words"}, "req-1", "chatcmpl-req-1"),  # a header not shown
    ],
)
def test_the_answer_shows_the_clients_request_id_as_vllm_does(server, kind, headers, request_id, shown, stream):
    async def go() -> tuple[int, dict, bytes]:
        call = Call(server.app, PATHS[kind], body(kind, request_id=request_id, stream=stream), headers)
        answer = await call.response()
        await settled(server)
        return answer

    status, head, raw = asyncio.run(go())
    assert status == 200 and head["x-request-id"] == shown
    ids = [e["id"] for e in events(raw)] if stream else [json.loads(raw)["id"]]
    assert ids and set(ids) == {shown}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_bad_request_id_is_an_openai_400_at_the_worker(server, kind):
    async def go() -> tuple[int, dict, bytes]:
        return await Call(server.app, PATHS[kind], body(kind, request_id="x" * 129)).response()

    status, _, raw = asyncio.run(go())
    err = error_of(status, raw)
    assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == "request_id"
    assert err["code"] == "invalid_request"  # a field checked, not one refused as unsupported
    assert server.in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
def test_requests_sharing_a_request_id_at_once_each_get_their_own_tokens(server, stream):
    """Three requests with one `request_id` and n=2 (one client's twice, another's once), all
    admitted before any step ends: each choice gets the tokens its prompt gets alone, every
    engine request has a key of its own that is not the client's id, and the worker goes on."""
    prompts = ["one prompt about caches", "one prompt about caches", "another about routing"]
    many = {"n": 2, "max_tokens": 24, "stream": stream, "request_id": "dup"}
    keys: list[str] = []
    submit = server.engine.submit

    def spied(request_id: str, *args, **kw) -> None:
        keys.append(request_id)
        submit(request_id, *args, **kw)

    def tokens(raw: bytes) -> dict[int, list[int]]:
        """Each choice's token ids, and the one id every chunk or answer shows."""
        parts = events(raw) if stream else [json.loads(raw)]
        assert {p["id"] for p in parts} == {"cmpl-dup"}
        got: dict[int, list[int]] = {}
        for choice in (c for p in parts for c in p["choices"]):
            got.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
        return got

    async def go() -> tuple[list, list]:
        alone = [
            await Call(server.app, PATHS["completion"], body("completion", p, n=2, max_tokens=24)).response()
            for p in prompts[1:]
        ]
        opened = threading.Event()
        server.engine.executor.wait = lambda _: opened.wait(GUARD_S)
        server.engine.submit = spied
        calls = [Call(server.app, PATHS["completion"], body("completion", p, **many)) for p in prompts]
        await until(lambda: server.in_flight == 6, "all three requests admitted")
        opened.set()
        answers = [await c.response() for c in calls]
        await settled(server)
        return alone, answers

    alone, answers = asyncio.run(go())
    want = [json.loads(raw)["choices"] for _, _, raw in alone]
    want_of = {p: {c["index"]: c["token_ids"] for c in w} for p, w in zip(prompts[1:], want)}
    assert want_of[prompts[0]] != want_of[prompts[2]]
    for prompt, (status, head, raw) in zip(prompts, answers):
        assert status == 200 and head["x-request-id"] == "cmpl-dup"
        assert tokens(raw) == want_of[prompt]
    assert len(keys) == len(set(keys)) == 6 and not any("dup" in k for k in keys)
