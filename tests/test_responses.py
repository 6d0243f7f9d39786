"""The Responses API's rules without processes: the id ledger's bound and TTL, the create
fields the gateway reads, the tokens a create is charged for, the id found in an answer's head,
a retrieve's query, the shared ledger's signed records, and the refusals that need no worker
(tests/test_vllm_responses.py has the routing through a real gateway)."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from gateway.admission import Admission
from gateway.auth import LIMITED_PATHS, SCOPE_KEY, Access, ApiKey, limited
from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.intake import ApiError, Intake
from gateway.record import RequestRecord
from gateway.response_fields import create_fields, input_texts, retrieve_query
from gateway.response_ids import MAX_ID_CHARS, Owner, ResponseIds, valid_id
from gateway.response_tap import HEAD_BYTES, IdTap, Opening, answer_id
from gateway.local_responses import LocalResponses
from gateway.response_store import ResponseStore
from gateway.responses import CREATE, LOOKUP_FAILED, NOT_FOUND, RETRIEVE, UNAVAILABLE, Responses
from gateway.shared_response_store import SharedResponseStore
from gateway.shared_response_ids import SharedResponseIds
from gateway.vllm_worker import KIND as VLLM

MODEL = "smollm2-135m"
A, B = Owner("w0", "a"), Owner("w1", "b")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_ledger_forgets_the_least_recently_used_beyond_its_size():
    ids = ResponseIds(size=3, ttl_s=100.0, clock=Clock())
    for i in range(3):
        ids.record(f"resp_{i}", A)
    assert ids.find("resp_0") == A  # now the most recently used
    ids.record("resp_3", B)
    assert len(ids) == 3 and ids.find("resp_1") is None
    assert [ids.find(f"resp_{i}") for i in (0, 2, 3)] == [A, A, B]
    ids.record("resp_2", B)  # recorded again: its new owner, the most recent
    ids.record("resp_4", A)
    assert ids.find("resp_0") is None and ids.find("resp_2") == B


def test_the_ledger_forgets_an_entry_its_ttl_after_it_was_recorded():
    clock = Clock()
    ids = ResponseIds(size=10, ttl_s=60.0, clock=clock)
    ids.record("resp_old", A)
    ids.record("resp_short", B, ttl_s=5.0)  # a shared entry with 5 s left in Redis
    ids.record("resp_long", B, ttl_s=1000.0)  # never past the ledger's own TTL
    clock.now = 5.0
    assert ids.find("resp_short") is None and ids.find("resp_old") == A
    clock.now = 59.9
    assert ids.find("resp_old") == A  # a lookup does not extend it
    clock.now = 60.0
    assert ids.find("resp_old") is None and ids.find("resp_long") is None and len(ids) == 0


def test_an_id_is_bounded_before_it_is_recorded():
    ids = ResponseIds()
    for bad in ("", "r" * (MAX_ID_CHARS + 1), "resp/../x", "resp x", "résp", "resp\n"):
        assert not valid_id(bad) and not ids.record(bad, A) and len(ids) == 0, bad
    assert valid_id("r" * MAX_ID_CHARS) and valid_id("resp_0a1B-2.3:4")
    with pytest.raises(ValueError):
        ResponseIds(size=0)
    with pytest.raises(ValueError):
        ResponseIds(ttl_s=0.0)


BAD_FIELDS = [
    ({"previous_response_id": 5}, "previous_response_id"),
    ({"previous_response_id": ""}, "previous_response_id"),
    ({"previous_response_id": "r" * (MAX_ID_CHARS + 1)}, "previous_response_id"),
    ({"stream": "true"}, "stream"),
    ({"store": 1}, "store"),
    ({"background": "yes"}, "background"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": True}, "max_output_tokens"),
    ({"max_output_tokens": 1.5}, "max_output_tokens"),
    ({"instructions": ["a"]}, "instructions"),
    ({"cache_salt": 7}, "cache_salt"),
    ({"request_id": "resp_another_tenants"}, "request_id"),
]


@pytest.mark.parametrize("fields, param", BAD_FIELDS)
def test_a_bad_field_the_gateway_reads_names_its_param(fields, param):
    with pytest.raises(ApiError) as e:
        create_fields({"model": MODEL, "input": "hi", **fields})
    assert e.value.status == 400 and e.value.param == param, str(e.value)


def test_the_fields_default_as_vllms():
    got = create_fields({"input": "hi", "stream": None, "tools": [{"type": "x"}], "max_output_tokens": 8})
    assert (got.previous_response_id, got.stream, got.store, got.background, got.max_output_tokens) == (
        None,
        False,
        True,  # vLLM stores by default
        False,
        8,
    )
    assert create_fields({"store": False, "stream": True, "previous_response_id": "resp_1"}).store is False


def test_a_creates_input_texts_are_what_its_key_is_charged_for():
    message = {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "url": "x"}]}
    call = {"type": "function_call_output", "call_id": "c", "output": "42"}
    assert input_texts({"input": "hi", "instructions": "be brief"}) == (["be brief", "hi"], False)
    assert input_texts({"input": [{"role": "user", "content": "hi"}]}) == (["hi"], False)
    assert input_texts({"input": [message]}) == (["a"], True)  # the image is estimated by bytes
    assert input_texts({"input": [call, {"role": "user", "content": "b"}]}) == (["b"], True)
    for bad in ({}, {"input": 5}, {"input": ["hi"]}, {"input": [{"content": 5}]}, {"input": [{"content": ["a"]}]}):
        with pytest.raises(ApiError) as e:
            input_texts(bad)
        assert e.value.status == 400 and e.value.param == "input", bad


WHOLE = b'{"id":"resp_0a1b","created_at":1,"object":"response","output":[]}'
CREATED = (
    b'event: response.created\ndata: {"response":{"id":"resp_2c3d","created_at":1,"output":[]},'
    b'"sequence_number":0,"type":"response.created"}\n\n'
)


def test_an_answers_id_is_found_in_its_head_however_it_is_cut():
    for answer, streamed, rid in ((WHOLE, False, "resp_0a1b"), (CREATED, True, "resp_2c3d")):
        found: list[str] = []
        tap = IdTap(streamed, found.append)
        for i in range(len(answer)):  # a byte at a time
            tap(answer[i : i + 1])
        tap(answer)  # later chunks are not read
        assert found == [rid] and tap.id == rid
    assert answer_id(b'{ "id" : "resp_x" }', False) == "resp_x"
    assert answer_id(b'{"object":"response","id":"resp_x"}', False) is None  # not vLLM's first field
    assert answer_id(b'event: response.in_progress\ndata: {"response":{"id":"resp_x"}}', True) is None
    assert answer_id(CREATED, False) is None and answer_id(WHOLE, True) is None


def test_a_streams_opening_ends_with_its_first_event_past_created_and_in_progress_however_it_is_cut():
    progress = CREATED.replace(b"response.created", b"response.in_progress")
    long = b'event: response.in_progress\ndata: {"response":{"instructions":"' + b"x" * 5000 + b'"}}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"delta":"ok"}\n\n'
    stream = CREATED + progress + long + delta
    end = len(stream) - len(delta) + delta.index(b"\n")  # where the first output event's `event:` line ends
    for size in (1, 7, 200, len(stream)):
        calls: list[int] = []
        opening = Opening(lambda: calls.append(1))
        at = None
        for i in range(0, len(stream), size):
            opening(stream[i : i + size])
            if calls and at is None:
                at = i
        opening(delta)
        assert len(calls) == 1 and at == end // size * size, size  # once, on the chunk that ends that line


def test_the_tap_gives_up_after_its_head_bytes():
    found: list[str] = []
    tap = IdTap(False, found.append)
    tap(b" " * (HEAD_BYTES - 1))
    assert not tap.done
    tap(b' {"id":"resp_late"}')
    assert tap.done and found == [] and len(tap.head) == HEAD_BYTES


def request(query: bytes = b"", key: ApiKey | None = None, path: str = "/v1/responses") -> Request:
    scope = {"type": "http", "method": "GET", "path": path, "headers": [], "query_string": query}
    return Request({**scope, SCOPE_KEY: key} if key else scope)


def test_a_retrieves_query_is_checked_and_only_vllms_parameters_go_on():
    assert retrieve_query(request(b"")) == ""
    assert retrieve_query(request(b"include[]=x&stream=true&starting_after=007")) == "?stream=true&starting_after=7"
    for bad, param in ((b"stream=1", "stream"), (b"starting_after=-1", "starting_after")):
        with pytest.raises(ApiError) as e:
            retrieve_query(request(bad))
        assert e.value.status == 400 and e.value.param == param
    with pytest.raises(ApiError):
        retrieve_query(request(b"starting_after=99999999999"))


def test_a_shared_record_counts_only_when_the_fleets_token_signed_it_for_its_id():
    shared = SharedResponseIds("redis://127.0.0.1:1", "fleet-secret")
    record = {"worker": "w0", "tenant": "a", "replayable": False, "sig": shared.sign("resp_1", A)}
    assert shared.parse("resp_1", json.dumps(record).encode()) == A
    replayable = Owner("w0", "a", True)
    assert (
        shared.parse(
            "resp_1", json.dumps({**record, "replayable": True, "sig": shared.sign("resp_1", replayable)}).encode()
        )
        == replayable
    )
    forged = [
        ("resp_2", record),  # copied under another id
        ("resp_1", {**record, "tenant": "b"}),  # handed to another tenant
        ("resp_1", {**record, "worker": "w1"}),  # pointed at another worker
        ("resp_1", {**record, "replayable": True}),  # a replay asked of a server that kept no events
        ("resp_1", {"worker": "w0", "tenant": "a", "sig": record["sig"]}),
        ("resp_1", {**record, "sig": SharedResponseIds("redis://x", "other").sign("resp_1", A)}),
        ("resp_1", {"worker": 5, "tenant": "a", "sig": "x"}),
        ("resp_1", {**record, "worker": "w" * 300}),
    ]
    for rid, bad in forged:
        assert shared.parse(rid, json.dumps(bad).encode()) is None, bad
    assert shared.parse("resp_1", b"[" * 10_000) is None and shared.parse("resp_1", b"x" * 2000) is None
    assert shared.malformed == len(forged) + 2


def test_the_retrieve_and_cancel_paths_are_rate_limited():
    assert "/v1/responses" in LIMITED_PATHS
    assert limited("/v1/responses/resp_1") and limited("/v1/responses/resp_1/cancel") and not limited("/v1/models")


def responses(kind: str) -> Responses:
    """Responses over a fleet of one healthy worker of `kind` serving MODEL, never contacted."""
    fleet = Fleet(ResidencyIndex(), kinds={VLLM: None})
    w = fleet.add("http://127.0.0.1:1", kind=kind)
    w.healthy, w.worker_id, w.state = True, "w0", {"model": MODEL}
    forwarder = SimpleNamespace(fleet=fleet, intake=Intake(fleet, None, Access(), None, None), admission=Admission())
    return Responses(forwarder, ResponseIds())


def refusal(r: Responses, body: dict, key: ApiKey | None = None) -> ApiError:
    raw = json.dumps({"model": MODEL, "input": "hi", **body}).encode()

    async def create() -> None:
        try:
            await r.create(request(key=key), raw, RequestRecord("r", CREATE, 0.0))
        finally:
            await r.close()

    with pytest.raises(ApiError) as e:
        asyncio.run(create())
    return e.value


def test_a_model_of_kvgate_workers_has_no_responses_api_without_the_gateways_own():
    """The gateway serves one for them over its chat path (gateway/local_responses.py,
    tests/test_local_responses.py); without it, the model is not supported."""
    e = refusal(responses("kvgate"), {})
    assert e.status == 400 and e.code == "model_not_supported" and e.param == "model"


def test_a_follow_up_goes_nowhere_but_where_its_response_is():
    r = responses(VLLM)
    key_a, key_b = (ApiKey(t, t.encode(), t, None) for t in ("a", "b"))
    r.ids.record("resp_a", Owner("w0", "a"))
    r.ids.record("resp_gone", Owner("w9", "a"))  # its worker has left the fleet
    e = refusal(r, {"previous_response_id": "resp_a"}, key_b)
    assert (e.status, e.code, e.param) == (404, NOT_FOUND, "previous_response_id")
    e = refusal(r, {"previous_response_id": "resp_a"})  # no key: not tenant a's
    assert (e.status, e.code) == (404, NOT_FOUND)
    e = refusal(r, {"previous_response_id": "resp_gone"}, key_a)
    assert (e.status, e.code, e.type, e.retry_after) == (503, UNAVAILABLE, "server_error", 1)
    r.forwarder.fleet.workers["http://127.0.0.1:1"].suspect = True  # it broke an answer off
    e = refusal(r, {"previous_response_id": "resp_a"}, key_a)
    assert (e.status, e.code) == (503, UNAVAILABLE)


def test_another_tenants_id_known_here_is_asked_of_redis_as_an_unknown_one_is():
    """Redis not answering, both are the same 503: a 404 for one against a 503 for the other
    told a client which ids exist."""
    key_b = ApiKey("b", b"b", "b", None)
    for rid in ("resp_a", "resp_0123456789abcdef"):
        r = responses(VLLM)
        r.shared = SharedResponseIds("redis://127.0.0.1:1", "fleet-secret")  # nothing listens there
        r.ids.record("resp_a", Owner("w0", "a"))
        e = refusal(r, {"previous_response_id": rid}, key_b)
        assert (e.status, e.code) == (503, LOOKUP_FAILED), rid


def test_an_id_redis_cannot_be_asked_about_is_a_503_not_a_404():
    """Another replica may have recorded it: "unknown" would tell the client it is gone."""
    r = responses(VLLM)
    r.shared = SharedResponseIds("redis://127.0.0.1:1", "fleet-secret")  # nothing listens there
    e = refusal(r, {"previous_response_id": "resp_elsewhere"})
    assert (e.status, e.code, e.type) == (503, LOOKUP_FAILED, "server_error")


def test_a_vllm_response_known_here_is_not_asked_of_redis_for_the_gateways_own():
    """A retrieve looks an id up among the gateway's own responses first (kvgate's workers), but
    Redis not answering that lookup must not fail a vLLM response this replica knows."""
    dead = "redis://127.0.0.1:1"  # nothing listens there
    r = responses(VLLM)
    r.shared = SharedResponseIds(dead, "fleet-secret")
    r.local = LocalResponses(None, ResponseStore(shared=SharedResponseStore(dead, "fleet-secret")))  # type: ignore[arg-type]
    r.ids.record("resp_v", Owner("w9", ""))  # its worker has left: a 503 of its own, not of the lookup

    def retrieve(rid: str) -> ApiError:
        scope = {"type": "http", "method": "GET", "path": f"/v1/responses/{rid}", "headers": [], "query_string": b""}

        async def go() -> None:
            try:
                await r.stored(
                    Request({**scope, "path_params": {"response_id": rid}}), RETRIEVE, RequestRecord("r", RETRIEVE, 0.0)
                )
            finally:
                await r.close()

        with pytest.raises(ApiError) as e:
            asyncio.run(go())
        return e.value

    assert retrieve("resp_v").code == UNAVAILABLE
    assert retrieve("resp_unknown").code == LOOKUP_FAILED
