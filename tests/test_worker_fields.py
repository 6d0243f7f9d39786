"""A sim worker's app against what a hostile client or peer sends in the fields it reads: the
internal token's header, `/kv/events`' query, request fields it does not implement, and KV
transfer headers. Each is a 4xx naming what was wrong, never a 500 or a stalled loop."""

import asyncio
import json
import struct

import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.testclient import TestClient

from tests.sim_engine import sim_engine
from workers.control_routes import MIN_HEARTBEAT_S
from workers.internal_auth import token_matches
from workers.kv.hashing import block_hash, seed_hash
from workers.sampling_params import InvalidRequest
from workers.server import WorkerServer
from workers.transfer import MAGIC, MAX_HEADER_BYTES, KVSpec, decode_header

TOKEN = {"x-kvgate-token": "t"}
BODY = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}


@pytest.fixture(scope="module")
def server():
    eng = sim_engine(num_blocks=16, block_size=4)
    eng.start()
    return WorkerServer(eng, "m", vocab_size=1000, internal_token="t")


@pytest.fixture(scope="module")
def client(server):
    with TestClient(server.app, raise_server_exceptions=False) as c:
        yield c


# -- the internal token's header ----------------------------------------------------------------


def test_only_the_tokens_own_bytes_match():
    assert token_matches("t", "t")
    assert not token_matches("\xff", "t") and not token_matches("t\u2603", "t") and not token_matches(None, "t")
    assert not token_matches("t", None) and not token_matches("", "")


@pytest.mark.parametrize("path", ["/state", "/steps", "/kv/events", "/kv/snapshot"])
def test_a_non_ascii_token_header_is_a_403_on_internal_reads(client, path):
    r = client.get(path, headers={"x-kvgate-token": b"\xff"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


def test_a_non_ascii_token_header_is_no_token_on_completions_and_imports(client):
    bad = {"x-kvgate-token": b"t\xff"}
    assert client.post("/v1/completions", json=BODY, headers=bad).status_code == 200
    r = client.post("/v1/completions", json={**BODY, "kv_transfer": {"wait_ms": 1}}, headers=bad)
    assert r.status_code == 403 and r.json()["error"]["param"] == "kv_transfer"
    r = client.post("/kv/import", content=b"KVG1", headers=bad)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


# -- /kv/events' query --------------------------------------------------------------------------


def kv_events(server: WorkerServer, query: str) -> Response:
    """The answer to GET /kv/events?`query`, not read: a stream's body never ends."""
    headers = [(b"x-kvgate-token", b"t")]
    scope = {"type": "http", "method": "GET", "path": "/kv/events", "query_string": query.encode(), "headers": headers}
    return asyncio.run(server.control.kv_events(Request(scope)))


@pytest.mark.parametrize("timeout", ["nan", "NaN", "inf", "-inf", "1e-300", "0", "-1", "0.01"])
def test_a_kv_events_stream_needs_a_finite_heartbeat_of_at_least_the_floor(server, timeout):
    r = kv_events(server, f"stream=1&timeout={timeout}")
    assert r.status_code == 400 and json.loads(bytes(r.body))["error"]["param"] == "timeout"
    assert isinstance(kv_events(server, f"stream=1&timeout={MIN_HEARTBEAT_S}"), StreamingResponse)


@pytest.mark.parametrize("timeout", ["nan", "inf"])
def test_a_kv_events_long_poll_needs_a_finite_timeout(client, timeout):
    r = client.get(f"/kv/events?timeout={timeout}", headers=TOKEN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"
    assert client.get("/kv/events?timeout=1e-300", headers=TOKEN).status_code == 200


def test_a_kv_events_stream_lets_other_tasks_run_between_its_lines():
    """Lines whose waits end at once (a busy engine's, or a wait of 0) still give the loop a
    turn each: another task advances between any two lines."""
    server = WorkerServer(sim_engine(), "m", vocab_size=1000, internal_token="t")

    async def run() -> list[int]:
        server.control.start(asyncio.get_running_loop())
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker, seen = asyncio.create_task(tick()), []
        async for _ in server.control._event_lines(0, 0.0, True, False):
            seen.append(ticks)
            if len(seen) == 5:
                break
        ticker.cancel()
        return seen

    seen = asyncio.run(run())
    assert all(later > earlier for earlier, later in zip(seen, seen[1:])), seen


# -- request fields the workers do not implement ------------------------------------------------

UNIMPLEMENTED = [
    ("guided_json", {"type": "object"}),
    ("guided_choice", ["a", "b"]),
    ("guided_regex", "a+"),
    ("guided_grammar", "root ::= 'a'"),
    ("structured_outputs", {"regex": "a+"}),
    ("use_beam_search", True),
    ("truncate_prompt_tokens", 1),
    ("truncate_prompt_tokens", -1),
]
NO_OPS = {
    "use_beam_search": False,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "bad_words": [],
    "allowed_token_ids": None,
    "guided_json": None,
    "structured_outputs": None,
    "truncate_prompt_tokens": None,
    "stream_options": None,
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field,value", UNIMPLEMENTED)
def test_a_field_the_worker_does_not_implement_is_a_400_naming_it(client, path, field, value):
    body = {**BODY, "messages": [{"role": "user", "content": "hi"}], field: value}
    r = client.post(path, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field and error["code"] == "unsupported_parameter"
    assert field in error["message"]


def test_the_no_op_values_of_those_fields_are_served(client):
    assert client.post("/v1/completions", json={**BODY, **NO_OPS}).status_code == 200


@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_a_stream_is_a_400(client, stream):
    body = {**BODY, "stream": stream, "stream_options": {"include_usage": True}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = client.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200 and '"usage"' in r.text


# -- KV transfer headers ------------------------------------------------------------------------

BLOCK = [5, 6, 7, 8]


def framed(head: bytes, length: int | None = None) -> bytes:
    """A KVG1 transfer of `head` and no payload (the sim worker's K/V is 0 bytes a block)."""
    return MAGIC + struct.pack("<I", len(head) if length is None else length) + head


def header(spec: KVSpec, /, **fields) -> bytes:
    """A sound one-block header with `fields` in place of its own."""
    hashes = [str(block_hash(seed_hash("m", 4), BLOCK))]
    head = {"spec": spec.__dict__, "hashes": hashes, "tokens": [BLOCK], "parent": None, **fields}
    return framed(json.dumps(head).encode())


MALFORMED: dict[str, dict] = {
    "parent past 64 bits": {"parent": str(2**64)},
    "negative parent": {"parent": "-1"},
    "parent a number": {"parent": 12},
    "hash past 64 bits": {"hashes": [str(2**64)]},
    "hash with spaces": {"hashes": [" 1"]},
    "hash of 5000 digits": {"hashes": ["9" * 5000]},
    "hashes a string": {"hashes": "123"},
    "token past int64": {"tokens": [[2**63] * 4]},
    "negative token": {"tokens": [[-1, 6, 7, 8]]},
    "float token": {"tokens": [[5.0, 6, 7, 8]]},
    "bool token": {"tokens": [[True, 6, 7, 8]]},
    "tokens a dict": {"tokens": {"a": 1}},
    "spec a list": {"spec": [1]},
    "salt a number": {"cache_salt": 5},
}
RAW = {
    "nested 100k deep": framed(b"[" * 100_000),
    "nested 40 deep": framed(b"[" * 40 + b"]" * 40),
    "not an object": framed(b"[]"),
    "NaN": framed(b'{"spec": NaN}'),
    "header longer than the body": framed(b"{}", 10),
}


def malformed(spec: KVSpec) -> dict[str, bytes]:
    return {**{k: header(spec, **v) for k, v in MALFORMED.items()}, **RAW}


@pytest.mark.parametrize("shape", [*MALFORMED, *RAW])
def test_a_malformed_transfer_header_is_a_bad_kv_transfer(server, client, shape):
    body = malformed(server.transfer.spec)[shape]
    with pytest.raises(InvalidRequest) as e:
        decode_header(body, server.transfer.spec, server.transfer.host.kv_seed)
    assert e.value.code == "bad_kv_transfer"
    r = client.post("/kv/import", content=body, headers=TOKEN)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_kv_transfer"


def test_a_sound_header_is_imported(client):
    r = client.post("/kv/import", content=header(KVSpec("m", 4, "none", 0, 0, 0)), headers=TOKEN)
    assert r.status_code == 200 and r.json()["dropped"] == 0


def test_an_import_past_what_the_pool_holds_is_a_413_before_it_is_read_whole(server, client, monkeypatch):
    spec, pool = server.transfer.spec, server.engine.pool
    assert server.transfer.max_import_bytes == MAX_HEADER_BYTES + pool.num_blocks * spec.block_bytes()
    monkeypatch.setattr(server.transfer, "max_import_bytes", 1000)
    body = header(spec) + b"\0" * 1000
    r = client.post("/kv/import", content=body, headers=TOKEN)
    assert r.status_code == 413 and r.json()["error"]["code"] == "bad_kv_transfer"
    r = client.post("/kv/import", content=iter([body[:500], body[500:]]), headers=TOKEN)  # chunked: no length
    assert r.status_code == 413 and r.json()["error"]["code"] == "bad_kv_transfer"
