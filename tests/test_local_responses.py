"""The Responses API for a model of kvgate's own workers through real gateways and sim workers on
loopback: the gateway serves it over its chat path (same text as a chat with the same seed),
routes a follow-up where its history is cached, stores responses per tenant (shared by two
replicas through Redis), refuses what it does not serve, and turns a worker's death mid-stream
into response.failed."""

import json
import random

import httpx
import pytest

from gateway.procs import Proc, Worker, start_gateway, start_redis, stop_all, wait_for, wait_redis

MODEL = "smollm2-135m"
BLOCK = 16  # the workers' KV block size (tokens)
KEYS = [{"key": "sk-a", "name": "a"}, {"key": "sk-a2", "name": "a2", "tenant": "a"}, {"key": "sk-b", "name": "b"}]
WORDS = "the cache block model token worker gateway prefix decode prefill route fleet queue stream".split()
STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """redis-server, two sim workers publishing to it, two gateway replicas (prefix_affinity, API
    keys of tenants a and b) finding them there."""
    tmp = tmp_path_factory.mktemp("local-responses")
    logs = str(tmp)
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    server = wait_redis(start_redis(log_dir=logs))
    url = f"redis://127.0.0.1:{server.port}/0"
    workers = [Worker(worker_id=f"w{i}", redis=url, log_dir=logs) for i in range(2)]
    extra = ["--api-key-file", str(tmp / "keys.json")]
    gateways = [
        start_gateway([], "prefix_affinity", redis=url, name=f"gw-{c}", log_dir=logs, extra=[*extra, "--replica-id", c])
        for c in "ab"
    ]
    try:
        for w in workers:
            w.ready()
        for g in gateways:
            g.wait_ready(timeout=60)  # /health: 200 once it has a healthy worker (/v1/models needs a key)
            g.wait_healthy(2, timeout=30, what="2 workers discovered through redis")
        yield {"workers": workers, "a": gateways[0], "b": gateways[1]}
    finally:
        stop_all(gateways + workers + [server])


def call(gw: Proc, method: str, path: str, body: object = None, key: str = "sk-a") -> httpx.Response:
    return httpx.request(method, gw.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)


def create(gw: Proc, key: str = "sk-a", **fields) -> httpx.Response:
    return call(gw, "POST", "/v1/responses", {"model": MODEL, **fields}, key)


def events(gw: Proc, key: str = "sk-a", **fields) -> tuple[httpx.Response, list[dict]]:
    """A streamed create's response and its events' data, each checked to name its event."""
    body = {"model": MODEL, "stream": True, **fields}
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream("POST", gw.url + "/v1/responses", json=body, headers=headers, timeout=60) as r:
        return r, parse_events("\n".join(r.iter_lines()))


def parse_events(text: str) -> list[dict]:
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            name, data = block.strip().split("\n")
            d = json.loads(data.removeprefix("data: "))
            assert name == f"event: {d['type']}"
            out.append(d)
    return out


def chat_text(gw: Proc, messages: list[dict], **fields) -> str:
    r = call(gw, "POST", "/v1/chat/completions", {"model": MODEL, "messages": messages, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] for part in item["content"])


def test_a_create_is_the_chat_answer_as_a_response(fleet):
    gw = fleet["a"]
    before = gw.metric("kvgate_gateway_requests_total")
    r = create(
        gw, input="Tell me of caches", instructions="Answer briefly.", max_output_tokens=6, seed=5, metadata={"k": "v"}
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-kvgate-worker"] in {w.worker_id for w in fleet["workers"]}
    assert r.headers["x-kvgate-policy"] == "prefix_affinity"
    body = r.json()
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["model"] == MODEL
    # a sim worker never emits EOS: every answer runs out of max_output_tokens
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert (body["instructions"], body["max_output_tokens"], body["metadata"], body["store"]) == (
        "Answer briefly.",
        6,
        {"k": "v"},
        True,
    )
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    assert item["content"][0]["type"] == "output_text" and item["content"][0]["annotations"] == []
    usage = body["usage"]
    assert usage["output_tokens"] == 6 and usage["total_tokens"] == usage["input_tokens"] + 6
    assert (
        usage["output_tokens_details"] == {"reasoning_tokens": 0} and "cached_tokens" in usage["input_tokens_details"]
    )
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Tell me of caches"}]
    assert text_of(body) == chat_text(gw, messages, max_tokens=6, seed=5)
    assert gw.metric("kvgate_gateway_requests_total") >= before + 2  # counted as generation, as the chat is


def test_a_streamed_create_is_the_chat_stream_as_events(fleet):
    gw = fleet["a"]
    r, evs = events(gw, input="Stream of caches", max_output_tokens=12, seed=7)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [e["type"] for e in evs]
    deltas = [e for e in evs if e["type"] == "response.output_text.delta"]
    assert names == STREAM_ORDER + ["response.output_text.delta"] * len(deltas) + [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs))) and deltas
    text = "".join(d["delta"] for d in deltas)
    assert text == chat_text(gw, [{"role": "user", "content": "Stream of caches"}], max_tokens=12, seed=7)
    final = evs[-1]["response"]
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["id"] == final["id"]
    assert final["status"] == "incomplete" and text_of(final) == text and final["usage"]["output_tokens"] == 12
    got = call(fleet["a"], "GET", f"/v1/responses/{final['id']}")
    assert got.status_code == 200 and got.json() == final  # stored as streamed


def test_follow_ups_carry_the_history_and_go_where_it_is_cached(fleet):
    gw, rng = fleet["a"], random.Random(11)
    instructions = "Answer briefly."
    messages = [{"role": "system", "content": instructions}]
    previous, holder, prompt = None, None, 0
    for turn in range(3):
        said = words(rng, 120 if turn == 0 else 30)
        fields = {"previous_response_id": previous} if previous else {}
        r = create(gw, input=said, instructions=instructions, max_output_tokens=8, **fields)
        assert r.status_code == 200, r.text
        body = r.json()
        messages.append({"role": "user", "content": said})
        counted = call(gw, "POST", "/tokenize", {"model": MODEL, "messages": messages})
        assert body["usage"]["input_tokens"] == counted.json()["count"]  # the prompt is the whole history
        if turn:
            predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
            assert predicted >= prompt // BLOCK * BLOCK > 0, (turn, predicted, prompt)
            assert body["usage"]["input_tokens_details"]["cached_tokens"] >= prompt // BLOCK * BLOCK
            assert r.headers["x-kvgate-worker"] == holder and body["previous_response_id"] == previous
        previous, holder, prompt = body["id"], r.headers["x-kvgate-worker"], body["usage"]["input_tokens"]
        messages.append({"role": "assistant", "content": text_of(body)})


def test_a_response_is_its_tenants_on_every_replica(fleet):
    a, b = fleet["a"], fleet["b"]
    made = create(a, input="Mine", max_output_tokens=3).json()
    rid = made["id"]
    got = wait_for(
        lambda: (r := call(b, "GET", f"/v1/responses/{rid}")).status_code == 200 and r,
        timeout=10,
        what="the other replica to find the response through redis",
    )
    assert got.json() == made
    assert call(a, "GET", f"/v1/responses/{rid}", key="sk-a2").json() == made  # another key of tenant a
    follow = create(b, input="And more", max_output_tokens=3, previous_response_id=rid)
    assert follow.status_code == 200 and follow.json()["usage"]["input_tokens"] > made["usage"]["input_tokens"]
    unknown = "resp_" + "0" * 32
    for gw in (a, b):
        for path, param in ((f"/v1/responses/{rid}", "response_id"), (f"/v1/responses/{unknown}", "response_id")):
            r = call(gw, "GET", path, key="sk-b")
            assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
            assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
        r = create(gw, key="sk-b", input="x", previous_response_id=rid)
        assert (r.status_code, r.json()["error"]["param"]) == (404, "previous_response_id"), r.text
        assert call(gw, "POST", f"/v1/responses/{rid}/cancel", key="sk-b").status_code == 404
    cancel = call(a, "POST", f"/v1/responses/{rid}/cancel")  # not a background one: vLLM's and OpenAI's 400
    assert cancel.status_code == 400 and cancel.json()["error"]["param"] == "response_id", cancel.text
    replay = call(a, "GET", f"/v1/responses/{rid}?stream=true")
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"


def test_a_response_not_stored_cannot_be_retrieved_or_followed(fleet):
    gw = fleet["a"]
    r = create(gw, input="Forget me", max_output_tokens=2, store=False)
    assert r.status_code == 200 and r.json()["store"] is False
    rid = r.json()["id"]
    assert call(gw, "GET", f"/v1/responses/{rid}").status_code == 404
    r = create(gw, input="x", previous_response_id=rid)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    r = create(gw, input="x", previous_response_id="resp_never_made")
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input[0].content[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].type"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
        ({"input": "x", "metadata": {"k": "v" * 600}}, "metadata"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": "x", "kv_transfer": {}}, "kv_transfer"),
        ({"input": "cache " * 9000, "max_output_tokens": 8}, "input"),  # past the model's context: the chat path's 400
    ],
)  # fmt: skip
def test_a_field_not_served_is_an_openai_400_naming_it(fleet, fields, param):
    r = create(fleet["a"], **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_a_create_refused_for_its_fields_is_counted_as_a_refused_chat_is(fleet):
    """Both are generation requests: their 400s count in kvgate_gateway_requests_total."""
    gw = fleet["a"]
    before = gw.metric("kvgate_gateway_requests_total", status="400")
    assert create(gw, input="x", truncation="auto").status_code == 400
    assert call(gw, "POST", "/v1/chat/completions", {"model": MODEL, "messages": "x"}).status_code == 400
    assert gw.metric("kvgate_gateway_requests_total", status="400") == before + 2


@pytest.fixture
def dying(tmp_path):
    """A sim worker whose every step takes 30 ms, behind a gateway of its own."""
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({"base_ms": 30.0}))
    worker = Worker(worker_id="d0", log_dir=str(tmp_path), extra=["--sim-profile", str(profile)])
    gw = start_gateway([worker.url], "round_robin", name="gw-dying", log_dir=str(tmp_path))
    try:
        worker.ready()
        gw.wait_ready("/v1/models")
        gw.wait_healthy(1)
        yield worker, gw
    finally:
        stop_all([gw, worker])


def test_a_worker_dying_mid_stream_is_response_failed(dying):
    worker, gw = dying
    body = {"model": MODEL, "input": "Say a lot", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = []
        for line in lines:
            seen.append(line)
            if line == "event: response.output_text.delta":
                break
        worker.kill()
        evs = parse_events("\n".join(seen + list(lines)))
    assert [e["type"] for e in evs][:4] == STREAM_ORDER and evs[-1]["type"] == "response.failed"
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    final = evs[-1]["response"]
    assert (
        final["status"] == "failed" and final["error"]["code"] == "server_error" and "d0" in final["error"]["message"]
    )
    got = call(gw, "GET", f"/v1/responses/{final['id']}")
    assert got.status_code == 200 and got.json()["status"] == "failed"  # stored as the client saw it


def test_a_tenant_deletes_its_response_at_every_replica(fleet):
    """DELETE at replica a, of a response replica b holds a copy of: OpenAI's answer, then a 404
    for it everywhere (retrieve, follow-up, delete again); another tenant's DELETE of it is the
    404 of an unknown id and deletes nothing."""
    a, b = fleet["a"], fleet["b"]
    rid = create(a, input="Forget me", max_output_tokens=3).json()["id"]
    wait_for(lambda: call(b, "GET", f"/v1/responses/{rid}").status_code == 200, timeout=10, what="b's copy")
    other = call(a, "DELETE", f"/v1/responses/{rid}", key="sk-b")
    assert other.status_code == 404 and other.json()["error"]["code"] == "response_not_found", other.text
    assert call(b, "GET", f"/v1/responses/{rid}").status_code == 200
    gone = call(a, "DELETE", f"/v1/responses/{rid}", key="sk-a2")  # another key of the same tenant
    assert gone.status_code == 200, gone.text
    assert gone.json() == {"id": rid, "object": "response.deleted", "deleted": True}
    for gw in (a, b):
        r = call(gw, "GET", f"/v1/responses/{rid}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
        r = create(gw, input="and?", previous_response_id=rid)
        assert (r.status_code, r.json()["error"]["param"]) == (404, "previous_response_id"), r.text
        assert call(gw, "DELETE", f"/v1/responses/{rid}").status_code == 404
