"""A sim worker's app against what a hostile client or peer sends in the fields it reads: the
internal token's header, `/kv/events`' query, request fields it does not implement, and KV
transfer headers. Each is a 4xx naming what was wrong, never a 500 or a stalled loop."""

import pytest
from starlette.testclient import TestClient

from tests.sim_engine import sim_engine
from workers.internal_auth import token_matches
from workers.server import WorkerServer

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
