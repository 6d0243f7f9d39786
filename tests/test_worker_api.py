"""The worker's HTTP API on a sim worker process: OpenAI shapes, errors, KV endpoints, aborts."""

import json
import threading
import time

import httpx
import pytest

from gateway.procs import Worker
from workers.kv.hashing import block_hashes, seed_hash
from workers.model_store import load_tokenizer

MODEL = "smollm2-135m"
INTERNAL = {"x-kvgate-token": "api-token"}  # the fixture worker's internal token


@pytest.fixture(scope="module")
def worker():
    w = Worker(worker_id="api", extra=("--num-blocks", "64", "--max-model-len", "512", "--internal-token", "api-token"))
    try:
        yield w.ready()
    finally:
        w.kill()


def post(w, path, body, **kw):
    return httpx.post(w.url + path, json=body, timeout=30, **kw)


def test_completion_and_usage(worker):
    r = post(worker, "/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]


def test_chat_uses_the_chat_template(worker):
    tok = load_tokenizer(MODEL)
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    expected = tok.encode(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    r = post(worker, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["prompt_tokens"] == len(expected)


def test_streaming_ends_with_done_and_usage(worker):
    with httpx.stream(
        "POST",
        worker.url + "/v1/chat/completions",
        timeout=30,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
        ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": list(range(600))}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 513}, 400, "max_tokens"),  # past the whole context
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x"}, 400, "model"),
        ({"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs"),  # the sim executor has no distribution
        ({"model": MODEL, "messages": "nope"}, 400, "messages"),
    ],
)
def test_bad_input_gets_openai_errors(worker, body, status, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = post(worker, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_malformed_json(worker):
    r = httpx.post(worker.url + "/v1/completions", content=b"{nope", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_models_health_metrics_state(worker):
    assert httpx.get(worker.url + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(worker.url + "/health").status_code == 200
    assert "kvgate_worker_generation_tokens_total" in httpx.get(worker.url + "/metrics").text
    state = worker.state()
    assert state["worker_id"] == "api" and state["total_blocks"] == 64 and state["block_size"] == 16


@pytest.mark.parametrize("path", ["/state", "/steps", "/kv/events", "/kv/snapshot"])
def test_internal_reads_need_the_token(worker, path):
    """Residency and load are a prompt side channel: a worker with a token serves them only to
    the fleet (the gateway and tools send it); /health, /metrics and /v1/models stay open."""
    for headers in (None, {"x-kvgate-token": "wrong"}):
        r = httpx.get(worker.url + path, headers=headers)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert worker.internal(path).status_code == 200


def test_kv_events_long_poll_and_snapshot_agree_with_hashes(worker):
    seq = worker.internal("/kv/snapshot").json()["seq"]
    ids = list(range(1000, 1040))
    got = {}
    t = threading.Thread(
        target=lambda: got.update(worker.internal(f"/kv/events?after={seq}&timeout=10", timeout=15).json())
    )
    t.start()
    time.sleep(0.3)
    post(worker, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1})
    t.join()
    stored = [h for e in got["events"] if e["kind"] == "stored" for h in e["hashes"]]
    expected = block_hashes(ids, 16, seed_hash(MODEL, 16))
    assert stored[:2] == expected and got["events"][0]["seq"] == seq + 1
    snap = worker.internal("/kv/snapshot").json()
    assert set(expected) <= set(snap["hashes"]) and snap["seq"] >= got["last_seq"]


def test_kv_events_carry_the_state_when_asked(worker):
    """`state=1`: the answer carries the /state body, so a tailing gateway needs no poll."""
    seq = worker.internal("/kv/snapshot").json()["seq"]
    plain = worker.internal(f"/kv/events?after={seq}").json()
    got = worker.internal(f"/kv/events?after={seq}&state=1").json()
    assert "state" not in plain
    assert got["state"]["worker_id"] == "api" and got["state"]["total_blocks"] == 64
    assert got["state"]["engine_alive"] is True and got["state"].keys() == worker.state().keys()


def test_kv_events_stream_a_line_per_batch_with_heartbeats(worker):
    """`stream=1`: one response, a JSON line per batch of events (each with the state), and a
    heartbeat line (no events) each `timeout` while nothing happens."""
    seq = worker.internal("/kv/snapshot").json()["seq"]
    lines: list[dict] = []
    ids = list(range(3000, 3040))

    def follow() -> None:
        url = worker.url + f"/kv/events?after={seq}&timeout=0.3&state=1&stream=1"
        with httpx.stream("GET", url, headers=INTERNAL, timeout=15) as r:
            assert r.headers["content-type"].startswith("application/x-ndjson")
            for line in r.iter_lines():
                lines.append(json.loads(line))
                if any(e["kind"] == "stored" for b in lines for e in b["events"]) and not lines[-1]["events"]:
                    return

    t = threading.Thread(target=follow)
    t.start()
    post(worker, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1})
    t.join(20)
    assert not t.is_alive()
    events = [e for b in lines for e in b["events"]]
    assert [e["seq"] for e in events] == list(range(seq + 1, seq + 1 + len(events))), "each event once, in order"
    stored = [h for e in events if e["kind"] == "stored" for h in e["hashes"]]
    assert stored[:2] == block_hashes(ids, 16, seed_hash(MODEL, 16))
    assert all(b["state"]["worker_id"] == "api" for b in lines) and lines[-1]["events"] == []
    assert worker.internal(f"/kv/events?after={seq}&stream=1").status_code == 400, "a stream needs a heartbeat"


def test_kv_events_stream_delta_carries_what_changed(worker):
    """`delta=1`: a stream's first line carries the whole state, each later one only the fields
    that changed since the line before, so merging them in order gives each line's state."""
    seq = worker.internal("/kv/snapshot").json()["seq"]
    lines: list[dict] = []

    def follow() -> None:
        url = worker.url + f"/kv/events?after={seq}&timeout=0.3&state=1&delta=1&stream=1"
        with httpx.stream("GET", url, headers=INTERNAL, timeout=15) as r:
            for line in r.iter_lines():
                lines.append(json.loads(line))
                if any(b["events"] for b in lines) and not lines[-1]["events"]:
                    return

    t = threading.Thread(target=follow)
    t.start()
    post(worker, "/v1/completions", {"model": MODEL, "prompt": list(range(3100, 3140)), "max_tokens": 1})
    t.join(20)
    assert not t.is_alive()
    assert lines[0]["state"].keys() == worker.state().keys(), "the first line: the whole state"
    assert all("cost_model" not in b["state"] and "worker_id" not in b["state"] for b in lines[1:])
    merged: dict = {}
    for b in lines:
        merged |= b["state"]
    assert merged.keys() == worker.state().keys() and merged["waiting"] == merged["running"] == 0


def test_kv_events_stream_first_line_at_once(worker):
    """A stream's first line (here a heartbeat with the state) comes when it opens, not a
    heartbeat later: the gateway's poller stands down on it."""
    seq = worker.internal("/kv/events?after=0").json()["last_seq"]
    url = worker.url + f"/kv/events?after={seq}&timeout=30&state=1&stream=1"
    with httpx.stream("GET", url, headers=INTERNAL, timeout=10) as r:
        first = json.loads(next(r.iter_lines()))
    assert first["events"] == [] and first["state"]["worker_id"] == "api"


def test_client_disconnect_aborts_and_frees_blocks(worker):
    with httpx.stream(
        "POST",
        worker.url + "/v1/completions",
        timeout=30,
        json={"model": MODEL, "prompt": list(range(2000, 2100)), "max_tokens": 400, "ignore_eos": True, "stream": True},
    ) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        s = worker.state()
        if s["running"] == 0 and s["free_blocks"] == s["total_blocks"]:
            break
        time.sleep(0.05)
    assert s["running"] == 0 and s["free_blocks"] == s["total_blocks"]


def test_prefix_cache_reset_needs_token_and_evicts_everything(worker):
    post(worker, "/v1/completions", {"model": MODEL, "prompt": list(range(3000, 3040)), "max_tokens": 1})
    assert httpx.post(worker.url + "/kv/reset").status_code == 403
    r = httpx.post(worker.url + "/kv/reset", headers=INTERNAL)
    assert r.status_code == 200 and r.json()["evicted"] > 0
    snap = worker.internal("/kv/snapshot").json()
    assert snap["hashes"] == []
    last = worker.internal(f"/kv/events?after={snap['seq'] - 1}").json()["events"][-1]
    assert last["kind"] == "cleared"


def test_streams_complete_without_the_app_lifespan():
    """The engine posts each step's outputs to the loop that requests arrive on, bound on first
    use: an app served without lifespan events (mounted in another app, ASGITransport) streams
    every token (in fewer chunks than tokens where the reader lagged: they merge)."""
    import asyncio

    from tests.sim_engine import sim_engine
    from workers.server import WorkerServer

    eng = sim_engine()
    server = WorkerServer(eng, "m", vocab_size=1000)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://w") as c:

            async def one(i):
                body = {
                    "model": "m",
                    "prompt": [3 + i, 4, 5, 6],
                    "max_tokens": 8,
                    "stream": True,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    return [line async for line in r.aiter_lines() if line.startswith("data:")]

            return await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(4)]), 10)

    eng.start()
    try:
        outs = asyncio.run(go())
    finally:
        eng.stop()
    for o in outs:
        assert o[-1] == "data: [DONE]"
        assert sum(len(json.loads(line[6:])["choices"][0]["token_ids"]) for line in o[:-1]) == 8
