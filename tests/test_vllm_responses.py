"""vLLM's Responses API through a real gateway in front of fake vLLM servers (tests/fake_vllm.py,
whose in-memory store answers 404 for an id it did not make, as vLLM's does): a response's
follow-ups, retrieves and cancels reach the server that stored it, among several, through one
gateway or another replica sharing Redis; other tenants and unknown ids get the same 404."""

import json

import httpx
import pytest

from tests import vllm_data as vd
from tests.fake_vllm_gateway import control, start_fake
from gateway.procs import Proc, Worker, start_gateway, start_redis, stop_all, wait_redis

KEYS = [
    {"key": "sk-a", "name": "a"},
    {"key": "sk-a2", "name": "a2", "tenant": "a"},
    {"key": "sk-b", "name": "b"},
    {"key": "sk-tokens", "name": "tokens", "tpm": 40},
]


@pytest.fixture
def fakes(tmp_path):
    procs = [start_fake(tmp_path, f"fake-vllm-{i}") for i in range(2)]
    try:
        yield [p.wait_ready("/health", 60) for p in procs]
    finally:
        stop_all(procs)


def gateway(fakes: list[Proc], tmp_path, name: str = "gateway", redis: str | None = None, extra: tuple = ()) -> Proc:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "keys.json").write_text(json.dumps(KEYS))
    argv = ["--api-key-file", str(tmp_path / "keys.json"), "--breaker-failures", "100", *extra]
    gw = start_gateway([f"vllm:{f.url}" for f in fakes], extra=argv, name=name, redis=redis, log_dir=str(tmp_path))
    gw.wait_ready(timeout=60)
    gw.wait_healthy(len(fakes), 30, what="the fake vLLMs up")
    return gw


def call(gw: Proc, method: str, path: str, body: object = None, key: str = "sk-a", **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.request(method, gw.url + path, json=body, headers=headers, timeout=30, **kw)


def create(gw: Proc, key: str = "sk-a", **fields) -> httpx.Response:
    return call(gw, "POST", "/v1/responses", {"model": vd.MODEL, "input": "hi", **fields}, key)


def worker(fake: Proc) -> str:
    return f"vllm@127.0.0.1:{fake.port}"


def assert_not_found(r: httpx.Response, param: str) -> None:
    error = r.json()["error"]
    assert r.status_code == 404 and error["code"] == "response_not_found", r.text
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert not r.headers["x-kvgate-worker"]  # the gateway's answer: no worker was asked


def test_a_conversation_stays_on_the_server_that_stored_it(fakes, tmp_path):
    gw = gateway(fakes, tmp_path)
    try:
        first = create(gw)
        assert first.status_code == 200, first.text
        holder, rid = first.headers["x-kvgate-worker"], first.json()["id"]
        assert holder in {worker(f) for f in fakes}
        assert json.loads(first.json()["received"])["cache_salt"] == "tenant:a"  # the tenant's, as completions
        for _ in range(8):  # load ties are broken at random: a new create lands on either server
            r = create(gw, previous_response_id=rid)
            assert r.status_code == 200 and r.headers["x-kvgate-worker"] == holder, r.text
            assert r.json()["previous_response_id"] == rid
            rid = r.json()["id"]  # the chain goes on from the newest
        with httpx.stream(
            "POST",
            gw.url + "/v1/responses",
            json={"model": vd.MODEL, "input": "hi", "stream": True, "previous_response_id": rid},
            headers={"authorization": "Bearer sk-a2"},  # another key of the same tenant
            timeout=30,
        ) as r:
            text = r.read().decode()
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == holder, text
        assert text.startswith("event: response.created\ndata: ") and text.count("event: ") == 4  # relayed as sent
        streamed = json.loads(text.split("data: ", 1)[1].split("\n", 1)[0])["response"]["id"]
        got = call(gw, "GET", f"/v1/responses/{streamed}", params={"stream": "false", "starting_after": "3", "x": "y"})
        assert got.status_code == 200 and got.headers["x-kvgate-worker"] == holder, got.text
        assert got.json()["id"] == streamed and got.json()["query"] == "stream=false&starting_after=3"

        queued = create(gw, background=True, previous_response_id=streamed)
        assert queued.status_code == 200 and queued.json()["status"] == "queued", queued.text
        cancelled = call(gw, "POST", f"/v1/responses/{queued.json()['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.headers["x-kvgate-worker"] == holder, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        again = call(gw, "POST", f"/v1/responses/{queued.json()['id']}/cancel")
        assert again.status_code == 400 and again.json()["error"]["code"] == 400  # the server's own answer, relayed

        assert gw.metric("kvgate_gateway_requests_total") == 0  # counted as the forwarded endpoints are
    finally:
        gw.stop()


def test_other_tenants_unknown_and_unstored_ids_are_one_404(fakes, tmp_path):
    gw = gateway(fakes, tmp_path)
    try:
        rid = create(gw).json()["id"]
        for r in (
            create(gw, "sk-b", previous_response_id=rid),
            create(gw, previous_response_id="resp_0123456789abcdef"),
        ):
            assert_not_found(r, "previous_response_id")
        for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/cancel"):
            method = "GET" if path.endswith(rid) else "POST"
            assert_not_found(call(gw, method, path, key="sk-b"), "response_id")
            assert_not_found(call(gw, method, path.replace(rid, "resp_nope")), "response_id")
        other = call(gw, "GET", f"/v1/responses/{rid}", key="sk-b").json()["error"]["message"]
        unknown = call(gw, "GET", "/v1/responses/resp_0123456789abcdef", key="sk-b").json()["error"]["message"]
        assert other.replace(rid, "resp_0123456789abcdef") == unknown  # nothing tells one from the other

        # vLLM deletes no response: its owner's DELETE is a 405 that changes nothing, another's a 404
        deleted = call(gw, "DELETE", f"/v1/responses/{rid}")
        assert deleted.status_code == 405 and deleted.json()["error"]["code"] == "method_not_allowed", deleted.text
        assert deleted.headers["allow"] == "GET"
        other_method = call(gw, "PUT", f"/v1/responses/{rid}")
        assert other_method.status_code == 405 and set(other_method.headers["allow"].split(", ")) == {"GET", "DELETE"}
        assert call(gw, "GET", f"/v1/responses/{rid}").status_code == 200
        assert_not_found(call(gw, "DELETE", f"/v1/responses/{rid}", key="sk-b"), "response_id")

        unstored = create(gw, store=False)
        assert unstored.status_code == 200, unstored.text
        assert_not_found(create(gw, previous_response_id=unstored.json()["id"]), "previous_response_id")
        assert call(gw, "GET", "/v1/responses/" + "r" * 129).status_code == 404
        assert call(gw, "GET", f"/v1/responses/{rid}", params={"stream": "yes"}).json()["error"]["param"] == "stream"

        # a create is charged for its input and max_output_tokens: 30 + 1 tokens, then 1 + 15 more are over 40
        assert create(gw, "sk-tokens", input=" ".join(["word"] * 30), max_output_tokens=1).status_code == 200
        r = create(gw, "sk-tokens", input="word", max_output_tokens=15)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
        # without max_output_tokens, for the rest of the model's context (2048), which vLLM may generate
        r = create(gw, "sk-tokens", input="word")
        assert r.status_code == 429 and "2048 tokens" in r.json()["error"]["message"], r.text
    finally:
        gw.stop()


def test_a_stored_responses_unavailable_server_is_a_503_never_another_server(fakes, tmp_path):
    gw = gateway(fakes, tmp_path)
    try:
        first = create(gw)
        rid, holder = first.json()["id"], first.headers["x-kvgate-worker"]
        down = next(f for f in fakes if worker(f) == holder)
        control(down, health=503)
        gw.wait_healthy(1, 30, what="the holder out")
        for r in (create(gw, previous_response_id=rid), call(gw, "GET", f"/v1/responses/{rid}")):
            error = r.json()["error"]
            assert r.status_code == 503 and error["code"] == "response_worker_unavailable", r.text
            assert error["type"] == "server_error" and r.headers["retry-after"] == "1"
        assert create(gw).headers["x-kvgate-worker"] != holder  # a new conversation goes to the other
        control(down, health=200)
        gw.wait_healthy(2, 30, what="the holder back")
        assert create(gw, previous_response_id=rid).headers["x-kvgate-worker"] == holder

        for fake in fakes:  # servers without the Responses API (a pooling model): the client's 400
            control(fake, responses=False)
        r = create(gw)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
        for fake in fakes:
            control(fake, responses=True, answer=500)
        r = create(gw, previous_response_id=rid)  # the holder's failure: one try, the gateway's 502
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed", r.text
        assert gw.metric("kvgate_gateway_retries_total") == 0
    finally:
        gw.stop()


def test_replicas_sharing_redis_send_a_follow_up_to_the_server_that_stored_it(fakes, tmp_path):
    redis = start_redis(log_dir=str(tmp_path))
    procs = [redis]
    try:
        wait_redis(redis)
        url = f"redis://127.0.0.1:{redis.port}"
        one = gateway(fakes, tmp_path / "one", "gateway-one", url)
        procs.append(one)
        two = gateway(fakes, tmp_path / "two", "gateway-two", url)
        procs.append(two)
        for _ in range(4):  # a create lands on either server; the other replica learns which from Redis
            first = create(one)
            rid, holder = first.json()["id"], first.headers["x-kvgate-worker"]
            r = create(two, previous_response_id=rid)
            assert r.status_code == 200 and r.headers["x-kvgate-worker"] == holder, r.text
            got = call(two, "GET", f"/v1/responses/{rid}")
            assert got.status_code == 200 and got.headers["x-kvgate-worker"] == holder, got.text
            assert_not_found(call(two, "GET", f"/v1/responses/{rid}", key="sk-b"), "response_id")
    finally:
        stop_all(procs)


def test_a_create_generating_past_the_first_byte_timeout_is_answered_once_and_past_the_answer_timeout_is_a_504(
    fakes, tmp_path
):
    """A whole (non-streaming) create is answered only once generated: bounded by the answer
    timeout, not the first-byte one, and never re-sent to another server past it (that one
    would take as long)."""
    bounds = ("--upstream-first-byte-timeout", "0.3", "--upstream-answer-timeout", "1.5")
    gw = gateway(fakes, tmp_path, extra=bounds)
    try:
        for fake in fakes:
            control(fake, create_delay_s=0.8)
        r = create(gw)
        assert r.status_code == 200, r.text
        assert sum(control(f)["creates"] for f in fakes) == 1
        with httpx.stream(
            "POST",
            gw.url + "/v1/responses",
            json={"model": vd.MODEL, "input": "hi", "stream": True},
            headers={"authorization": "Bearer sk-a"},
            timeout=30,
        ) as s:
            assert s.status_code == 502  # a stream's head is bounded by the first-byte timeout
        for fake in fakes:
            control(fake, create_delay_s=3.0)
        before = sum(control(f)["creates"] for f in fakes)
        r = create(gw)
        error = r.json()["error"]
        assert r.status_code == 504 and error["code"] == "worker_timeout", r.text
        assert sum(control(f)["creates"] for f in fakes) == before + 1
    finally:
        for fake in fakes:
            control(fake, create_delay_s=0.0)
        gw.stop()


def stream_create(gw: Proc, **fields) -> str:
    """A streamed create's whole text (httpx raises if the gateway cuts it)."""
    body = {"model": vd.MODEL, "input": "hi", "stream": True, **fields}
    with httpx.stream(
        "POST", gw.url + "/v1/responses", json=body, headers={"authorization": "Bearer sk-a"}, timeout=30
    ) as r:
        assert r.status_code == 200
        return r.read().decode()


def test_only_a_background_stream_is_streamed_again_and_no_retrieve_counts_against_its_server(fakes, tmp_path):
    """vLLM keeps a response's events only when it was created with both background and
    stream; a `?stream=true` retrieve of any other it starts to answer, then breaks off. The
    gateway answers that one itself, and a retrieve a server does break off (the client steers
    it) counts in the metrics only: neither the server's breaker (one failure opens it here) nor
    suspect. HEAD on the retrieve route is a 405: a HEAD's answer has no body to relay."""
    gw = gateway(fakes, tmp_path, extra=("--breaker-failures", "1"))
    try:
        rid = create(gw).json()["id"]
        r = call(gw, "GET", f"/v1/responses/{rid}", params={"stream": "true"})
        error = r.json()["error"]
        assert r.status_code == 400 and (error["type"], error["param"]) == ("invalid_request_error", "stream"), r.text
        assert not r.headers["x-kvgate-worker"]  # the gateway's answer: no worker was asked
        assert call(gw, "GET", f"/v1/responses/{rid}").status_code == 200

        text = stream_create(gw, background=True)
        sid = json.loads(text.split("data: ", 1)[1].split("\n", 1)[0])["response"]["id"]
        r = call(gw, "GET", f"/v1/responses/{sid}", params={"stream": "true", "starting_after": "1"})
        assert r.status_code == 200 and r.text == text[text.index("event: response.output_text.delta") :], r.text
        holder = r.headers["x-kvgate-worker"]

        control(next(f for f in fakes if worker(f) == holder), replays=False)
        with pytest.raises(httpx.RemoteProtocolError):  # the server broke it off: so does the gateway
            call(gw, "GET", f"/v1/responses/{sid}", params={"stream": "true"})
        assert gw.metric("kvgate_gateway_upstream_failures_total", stage="stream") == 1
        r = create(gw, previous_response_id=sid)
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == holder, r.text

        r = httpx.head(gw.url + f"/v1/responses/{sid}", headers={"authorization": "Bearer sk-a"}, timeout=30)
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "DELETE"}, r.headers
        assert call(gw, "GET", f"/v1/responses/{sid}").status_code == 200
        assert gw.metric("kvgate_gateway_upstream_failures_total") == 1
        assert "is suspect" not in gw.log_path.read_text()
    finally:
        gw.stop()


def test_a_streams_wait_for_its_first_output_is_bounded_by_the_first_byte_timeout_not_the_idle_one(fakes, tmp_path):
    """vLLM opens a stream with response.created and response.in_progress at once, then says
    nothing until its first token (a loaded server's queue, a long prefill): that wait is a
    chat stream's wait for its first token, bounded by the first-byte timeout; the idle timeout
    bounds the silences after. Bytes are relayed as they come either way."""
    gw = gateway(fakes, tmp_path, extra=("--upstream-idle-timeout", "0.3", "--upstream-first-byte-timeout", "2"))
    try:
        for fake in fakes:
            control(fake, stream_wait_s=1.0)
        text = stream_create(gw)
        assert text.count("event: ") == 4 and "event: response.completed" in text, text
        assert gw.metric("kvgate_gateway_upstream_failures_total") == 0
        for fake in fakes:
            control(fake, stream_wait_s=0.0, stream_gap_s=1.0)
        with pytest.raises(httpx.RemoteProtocolError):  # silent past the idle timeout after its first output
            stream_create(gw)
        assert gw.metric("kvgate_gateway_upstream_failures_total", stage="stream") == 1
        for fake in fakes:
            control(fake, stream_wait_s=3.0, stream_gap_s=0.0)
        with pytest.raises(httpx.RemoteProtocolError):  # silent past the first-byte timeout before it
            stream_create(gw)
        assert gw.metric("kvgate_gateway_upstream_failures_total", stage="stream") == 2
    finally:
        gw.stop()


def test_a_mixed_model_chooses_by_its_kinds_of_worker_and_a_follow_up_by_where_its_id_is_known(tmp_path):
    """A model served by a vLLM server and a kvgate worker: the path was chosen by whether a
    *healthy* vLLM worker served it, so while the vLLM one was down a follow-up to its response
    was the gateway's own 404 (not the 503 that says it may come back), a vLLM-only field the
    gateway path's 400, and a response made on the gateway's path meanwhile could not be
    continued once vLLM was back. Now a create goes by the kinds the model has (registered,
    healthy or not), a follow-up, retrieve or cancel by where its id is known."""
    fake = start_fake(tmp_path, "fake-vllm").wait_ready("/health", 60)
    kvgate = Worker(worker_id="k0", log_dir=str(tmp_path))
    gw = None
    try:
        kvgate.ready()
        control(fake, health=503)  # never up yet: the gateway does not know it serves the model
        (tmp_path / "keys.json").write_text(json.dumps(KEYS))
        argv = ["--api-key-file", str(tmp_path / "keys.json"), "--breaker-failures", "100"]
        gw = start_gateway([f"vllm:{fake.url}", kvgate.url], extra=argv, log_dir=str(tmp_path))
        gw.wait_ready(timeout=60)
        gw.wait_healthy(1, 30, what="the kvgate worker up")
        prompt = " ".join(f"word{i}" for i in range(60))  # blocks k0 caches: a follow-up's chat goes there
        mine = create(gw, input=prompt, max_output_tokens=2)  # a model of kvgate's workers alone, for now
        assert mine.status_code == 200 and mine.headers["x-kvgate-worker"] == "k0", mine.text
        rid_local = mine.json()["id"]

        control(fake, health=200)
        gw.wait_healthy(2, 30, what="the vLLM server up")
        first = create(gw)  # the model has a vLLM worker: vLLM's Responses API
        assert first.status_code == 200 and first.headers["x-kvgate-worker"] == worker(fake), first.text
        rid_vllm = first.json()["id"]

        control(fake, health=503)
        gw.wait_healthy(1, 30, what="the vLLM server down")
        for r in (create(gw, previous_response_id=rid_vllm), call(gw, "GET", f"/v1/responses/{rid_vllm}")):
            error = r.json()["error"]
            assert r.status_code == 503 and error["code"] == "response_worker_unavailable", r.text
            assert r.headers["retry-after"] == "1"
        r = create(gw, tools=[{"type": "function", "name": "f", "parameters": {}}])  # vLLM's to serve
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_workers", r.text
        assert call(gw, "GET", f"/v1/responses/{rid_local}").json() == mine.json()

        control(fake, health=200)
        gw.wait_healthy(2, 30, what="the vLLM server back")
        follow = create(gw, input="and then?", max_output_tokens=2, previous_response_id=rid_local)
        assert follow.status_code == 200 and follow.headers["x-kvgate-worker"] == "k0", follow.text
        assert follow.json()["previous_response_id"] == rid_local
        assert follow.json()["usage"]["input_tokens"] > mine.json()["usage"]["input_tokens"]
        cancel = call(gw, "POST", f"/v1/responses/{rid_local}/cancel")  # the gateway's own: not a background one
        assert cancel.status_code == 400 and cancel.json()["error"]["param"] == "response_id", cancel.text
    finally:
        stop_all([p for p in (gw, kvgate, fake) if p is not None])
