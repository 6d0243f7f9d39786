"""A worker's request as it comes in: its body read (capped, and a client gone mid-body), its
choices counted in flight from admission, and the fields that bound what it may ask.

The rule: a request that ends early (its client left, a choice failed, the engine stops) leaves
nothing running for no one and nothing counted in flight, and its client (if still there) gets
an OpenAI-shaped error. The worker, driven in-process through its ASGI app: tests/asgi_worker.py.
"""

import asyncio
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.asgi_worker import (
    GUARD_S,
    MODEL,
    TOKEN,
    WORKER,
    Call,
    error_of,
    gate,  # noqa: F401 (a fixture)
    scope_of,
    server,  # noqa: F401 (a fixture)
    settled,
    until,
)
from workers.cli import build_server, parser
from workers.http_guard import DEFAULT_MAX_BODY_BYTES
from workers.server import WorkerServer


def client(server: WorkerServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://w", timeout=GUARD_S)


def test_a_requests_choices_count_in_flight_from_admission(gate):
    """A worker holding 4 requests at most (2 running + 2 queued) admits one asking for 16
    choices; while its choice 0 prefills, its 15 other choices (not in the engine yet) count
    too, so the next request is refused 503 overloaded. They once counted only once started,
    and every request admitted meanwhile would add its own 16 past the bound."""
    s = build_server(parser().parse_args([*WORKER, "--max-num-seqs", "2", "--max-queued-requests", "2"]))
    opened = threading.Event()
    s.engine.executor.wait = lambda _: opened.wait(GUARD_S)
    many = {"model": MODEL, "prompt": "hi", "n": 16, "max_tokens": 2}

    async def go():
        first = Call(s.app, "/v1/completions", many)
        await until(lambda: s.engine.has_work(), "choice 0 is in the engine")
        second = Call(s.app, "/v1/completions", {**many, "n": 1})
        await until(lambda: second.task.done() or s.in_flight == 2, "the second request is answered or admitted")
        opened.set()
        status, _, body = await second.response()
        answer = await first.response()
        await settled(s)
        return status, body, answer

    try:
        status, body, (first_status, _, first_body) = asyncio.run(go())
    finally:
        opened.set()
        s.engine.stop()
    assert status == 503 and error_of(status, body)["code"] == "overloaded"
    assert first_status == 200 and len(json.loads(first_body)["choices"]) == 16


def test_a_null_kv_wait_is_no_wait_and_leaks_nothing(server):
    """`kv_transfer.wait_ms: null` (with the internal token) is a request without a KV wait; it
    once raised after being counted in flight, and every such request stayed counted forever."""
    internal = {"x-kvgate-token": TOKEN}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "kv_transfer": {"wait_ms": None}}

    async def go():
        async with client(server) as c:
            answers = [await c.post("/v1/completions", json=body, headers=internal) for _ in range(3)]
            state = (await c.get("/state", headers=internal)).json()
            after = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        return answers, state, after

    answers, state, after = asyncio.run(go())
    assert state["in_flight"] == 0
    assert [r.status_code for r in answers] == [200] * 3, answers[0].text
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_body_said_to_be_past_the_cap_is_refused_unread(server, path):
    """Content-Length past the cap: a 413 before one byte of the body is read."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}

    async def go():
        call = Call(server.app, path, body, headers={"content-length": str(25 * DEFAULT_MAX_BODY_BYTES)})
        return *await call.response(), call.pulled

    status, _, answer, pulled = asyncio.run(go())
    assert status == 413 and error_of(status, answer)["code"] == "request_too_large"
    assert pulled == 0


def test_the_fleets_own_call_may_be_larger_than_a_clients(server):
    """A gateway's body is a client's (capped by the gateway) plus its token ids: with the
    internal token a body past the client cap is read (here its prompt then runs past the
    context: a 400), without it the same body is a 413."""
    body = {"model": MODEL, "prompt": "a " * (3 * DEFAULT_MAX_BODY_BYTES // 4), "max_tokens": 2}

    async def go(headers: dict) -> tuple[int, bytes]:
        status, _, answer = await Call(server.app, "/v1/completions", body, headers=headers).response()
        return status, answer

    fleet, client = asyncio.run(go({"x-kvgate-token": TOKEN})), asyncio.run(go({}))
    assert fleet[0] == 400 and error_of(*fleet)["code"] == "context_length_exceeded"
    assert client[0] == 413 and error_of(*client)["code"] == "request_too_large"


def test_a_chunked_body_is_refused_once_past_the_cap(server):
    """A chunked body is read only until it passes the cap, then answered 413 (the client here
    would send three times the cap)."""
    part = 2**20

    def chunks() -> Iterator[bytes]:
        yield json.dumps({"model": MODEL, "prompt": "a"})[:-2].encode()
        for _ in range(3 * DEFAULT_MAX_BODY_BYTES // part):
            yield b"a" * part

    async def go():
        call = Call(server.app, "/v1/completions", chunks())
        return *await call.response(), call.pulled

    status, _, answer, pulled = asyncio.run(go())
    assert status == 413 and error_of(status, answer)["code"] == "request_too_large"
    assert pulled <= DEFAULT_MAX_BODY_BYTES + part


def test_detokenize_takes_at_most_max_model_len_tokens(server):
    limit = server.engine.max_model_len

    async def go():
        async with client(server) as c:
            return [await c.post("/detokenize", json={"tokens": [5] * n}) for n in (limit, limit + 1, 10**6)]

    fits, over, far_over = asyncio.run(go())
    assert fits.status_code == 200 and fits.json()["prompt"]
    for r in (over, far_over):
        assert r.status_code == 400 and error_of(r.status_code, r.content)["param"] == "tokens"


def test_a_client_gone_mid_body_is_a_499_not_an_internal_error(server, caplog):
    """A client that leaves while sending its body (or is cut by the body timeout) is no fault
    of the worker's: a 499 for the log, no error logged, no 500."""
    parts = [{"type": "http.request", "body": b'{"model": "', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        sent.append(msg)

    scope = scope_of("/v1/completions", {"content-type": "application/json", "transfer-encoding": "chunked"})
    with caplog.at_level("ERROR"):
        asyncio.run(asyncio.wait_for(server.app(scope, receive, send), GUARD_S))
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
