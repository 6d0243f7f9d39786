"""The Responses API for kvgate's workers without processes: a create read as a hostile
client's, its chat completion, the chat's answer and stream turned back into a Response and its
events (the store: tests/test_response_store.py; through a real gateway and sim workers:
tests/test_local_responses.py)."""

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.intake import ApiError
from gateway.raw_send import RawBody
from tests.raw_client import Client
from gateway.relay import DONE
from gateway.response_chat import ChatAnswer, answered, as_responses_error, chat_body, chat_messages
from gateway.response_events import CUT_SHORT, ResponseEvents
from gateway.response_object import Usage, output_message, response_json, status_of
from gateway.response_request import MAX_ITEMS, CreateRequest, Message, parse_create
from gateway.response_stream import EventsBody

MODEL = "smollm2-135m"


def parse(**fields) -> CreateRequest:
    return parse_create({"model": MODEL, "input": "hi", **fields}, MODEL)


def refused(**fields) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(**fields)
    return e.value


def test_a_create_reads_its_fields_with_openais_defaults():
    req = parse()
    assert req.input == (Message("user", "hi"),) and req.store and not req.stream
    assert (req.temperature, req.top_p, req.max_output_tokens, req.metadata, req.tool_choice) == (
        None,
        None,
        None,
        {},
        "auto",
    )
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]},
    ]  # fmt: skip
    req = parse(input=items, temperature=0, top_p=0.5, max_output_tokens=9, store=False, metadata={"k": "v"}, seed=-3)
    assert req.input == (Message("developer", "be brief"), Message("user", "a\nb"), Message("assistant", "c"))
    assert (req.temperature, req.top_p, req.max_output_tokens, req.store, req.seed) == (0.0, 0.5, 9, False, -3)
    noops = {"tools": [], "tool_choice": "none", "text": {"format": {"type": "text"}}, "truncation": "disabled"}
    assert parse(**noops, reasoning={}, background=False, include=[], parallel_tool_calls=False).tool_choice == "none"


HOSTILE = [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": 7}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name"),
    ({"input": [{"role": "assistant", "content": "x", "status": "in_progress"}]}, "input[0].status"),
    ({"input": [{"role": "user", "content": "x"}] * (MAX_ITEMS + 1)}, "input"),
    ({"instructions": ["a"]}, "instructions"),
    ({"previous_response_id": 5}, "previous_response_id"),
    ({"previous_response_id": ""}, "previous_response_id"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": True}, "max_output_tokens"),
    ({"max_output_tokens": 2**31}, "max_output_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": 2**63}, "seed"),
    ({"stream": "true"}, "stream"),
    ({"store": 1}, "store"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"metadata": []}, "metadata"),
    ({"user": "u" * 257}, "user"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"request_id": "resp_another_tenants"}, "request_id"),
    ({"kv_transfer_params": {}}, "kv_transfer_params"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "p"}}, "prompt"),
]


@pytest.mark.parametrize("fields, param", HOSTILE)
def test_a_hostile_field_is_a_400_naming_its_param(fields, param):
    e = refused(**fields)
    assert e.status == 400 and e.param == param and e.type == "invalid_request_error", str(e)


def test_every_unknown_field_is_named():
    e = refused(zeta=1, alpha=2)
    assert e.param == "alpha" and "'alpha', 'zeta'" in str(e) and e.code == "unsupported_parameter"


def test_a_previous_id_no_response_can_have_is_the_404_of_an_unknown_one():
    e = refused(previous_response_id="resp/../x")
    assert (e.status, e.code, e.param) == (404, "response_not_found", "previous_response_id")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = st.sampled_from(
    ["input", "instructions", "previous_response_id", "max_output_tokens", "temperature", "top_p", "seed", "stream",
     "store", "metadata", "user", "text", "truncation", "tools", "tool_choice", "reasoning", "background", "include"]
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(FIELDS, JSON, max_size=4))
def test_any_json_in_any_field_is_read_or_refused_with_a_client_error(fields):
    try:
        parse_create({"model": MODEL, "input": "hi", **fields}, MODEL)
    except ApiError as e:
        assert e.status in (400, 404) and e.param


def test_the_chat_body_is_instructions_then_the_conversation():
    req = parse(instructions="be brief", max_output_tokens=7, temperature=0.5, seed=3, user="u", stream=True)
    history = (Message("user", "one"), Message("assistant", "two"))
    body = chat_body(req, history + req.input)
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "hi"},
    ]
    assert {k: body[k] for k in ("model", "max_tokens", "temperature", "seed", "user", "stream")} == {
        "model": MODEL, "max_tokens": 7, "temperature": 0.5, "seed": 3, "user": "u", "stream": True,
    }  # fmt: skip
    assert body["stream_options"] == {"include_usage": True} and "top_p" not in body
    assert "stream_options" not in chat_body(parse(), parse().input)


MESSAGES = st.lists(
    st.builds(Message, st.sampled_from(["user", "assistant", "system", "developer"]), st.text()), max_size=5
)


@given(MESSAGES, MESSAGES, st.text(), st.none() | st.text())
def test_a_follow_ups_chat_starts_with_its_previous_turns(turn1, turn2, reply, instructions):
    """So the prompt of a follow-up starts with its previous prompt's text, where the fleet has it cached."""
    first = parse_create({"model": MODEL, "input": "x", "instructions": instructions}, MODEL)
    conversation = tuple(turn1) + first.input
    stored = conversation + answered(
        response_json(first, "resp_1", 0, "completed", [output_message("m", reply, "completed")])
    )
    reply_message = [{"role": "assistant", "content": reply}] if reply else []  # no text: no message
    second = chat_messages(first, stored + tuple(turn2))
    assert second == chat_messages(first, conversation) + reply_message + [m.to_json() for m in turn2]


def test_a_chat_refusal_names_the_creates_param():
    assert as_responses_error(ApiError(400, "too long", param="messages")).param == "input"
    assert as_responses_error(ApiError(400, "too many", param="max_tokens")).param == "max_output_tokens"
    assert as_responses_error(ApiError(400, "bad", param="seed")).param == "seed"


CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "length"}],
    "usage": {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 8},
    },
}


def test_a_whole_chat_answer_is_read_and_its_status_follows_its_finish_reason():
    answer = ChatAnswer.from_whole(json.dumps(CHAT).encode())
    assert answer == ChatAnswer("hello", "length", Usage(10, 8, 2))
    assert answer.usage is not None and answer.usage.to_json() == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 12,
    }
    assert [status_of(r) for r in ("stop", "length", "abort", "error", None)] == [
        "completed", "incomplete", "failed", "failed", "failed",
    ]  # fmt: skip
    for bad in (b"[]", b'{"choices": []}', b'{"choices": [{"message": {"content": 5}}]}', b"nope"):
        with pytest.raises(ValueError):
            ChatAnswer.from_whole(bad)
    assert Usage.from_chat({"prompt_tokens": -1, "completion_tokens": 2}) is None
    assert Usage.from_chat({"prompt_tokens": True, "completion_tokens": 2}) is None


# The usage fields vLLM 0.32 (vllm/entrypoints/openai/responses/protocol.py: ResponseUsage,
# InputTokensDetails, OutputTokensDetails) and the openai package's types (openai 2.x,
# openai/types/responses/response_usage.py) require, which the OpenAI SDK's Response refuses
# a usage without: `input_tokens`, `input_tokens_details` {`cached_tokens`,
# `cache_write_tokens`}, `output_tokens`, `output_tokens_details` {`reasoning_tokens`},
# `total_tokens`.
USAGE_FIELDS = {"input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details", "total_tokens"}
INPUT_DETAILS, OUTPUT_DETAILS = {"cached_tokens", "cache_write_tokens"}, {"reasoning_tokens"}


def assert_usage_fields(usage: dict) -> None:
    assert set(usage) >= USAGE_FIELDS, usage
    assert set(usage["input_tokens_details"]) >= INPUT_DETAILS and set(usage["output_tokens_details"]) >= OUTPUT_DETAILS


def test_a_whole_answer_and_a_streams_responses_carry_every_usage_field_openai_requires():
    """openai is not installed in the gateway's venv: the required fields are listed above, as
    read from vLLM's and openai's code (tests/test_response_openai_types.py validates against
    the types themselves, in vLLM's venv)."""
    assert_usage_fields(Usage(10, 8, 2).to_json())
    events, _ = converted(STREAM, [])
    for _, event in events:
        usage = event["response"]["usage"] if "response" in event else None
        if usage is not None:
            assert_usage_fields(usage)
    assert events[-1][1]["response"]["usage"]["input_tokens_details"]["cache_write_tokens"] == 0


def test_a_response_echoes_its_request():
    req = parse(
        instructions="i",
        max_output_tokens=4,
        temperature=0.2,
        metadata={"a": "b"},
        user="u",
        previous_response_id="resp_0",
    )
    r = response_json(req, "resp_1", 5, "incomplete", [], Usage(3, 0, 4))
    assert (r["id"], r["object"], r["created_at"], r["status"], r["incomplete_details"]) == (
        "resp_1", "response", 5, "incomplete", {"reason": "max_output_tokens"},
    )  # fmt: skip
    assert (r["instructions"], r["max_output_tokens"], r["temperature"], r["top_p"], r["metadata"], r["user"]) == (
        "i", 4, 0.2, 1.0, {"a": "b"}, "u",
    )  # fmt: skip
    assert r["previous_response_id"] == "resp_0" and r["usage"]["total_tokens"] == 7 and r["error"] is None
    failed = response_json(req, "resp_1", 5, "failed", [], None, "boom")
    assert failed["error"] == {"code": "server_error", "message": "boom"} and failed["incomplete_details"] is None


def chunk(content: str | None = None, finish: str | None = None, role: bool = False) -> bytes:
    delta = ({"role": "assistant"} if role else {}) | ({"content": content} if content is not None else {})
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


USAGE = b'data: {"choices": [], "usage": ' + json.dumps(CHAT["usage"]).encode() + b"}\n\n"
STREAM = chunk("", role=True) + chunk("hel") + chunk("lo") + chunk(finish="length") + USAGE + b"data: [DONE]\n\n"


def events_of(out: bytes) -> list[tuple[str, dict]]:
    events = []
    for event in out.split(b"\n\n"):
        if event:
            name, data = event.split(b"\n")
            assert name.startswith(b"event: ") and data.startswith(b"data: ")
            d = json.loads(data[6:])
            assert d["type"] == name[7:].decode()
            events.append((d["type"], d))
    return events


def converted(stream: bytes, cuts: list[int], tail: int = 0) -> tuple[list[tuple[str, dict]], list[dict]]:
    ended: list[dict] = []
    events = ResponseEvents(parse(max_output_tokens=3), "resp_1", 7, ended.append)
    body, last = stream[: len(stream) - tail], stream[len(stream) - tail :]
    out, at = b"", 0
    for cut in sorted(c for c in cuts if c < len(body)) + [len(body)]:
        out += events.feed(body[at:cut])
        at = cut
    return events_of(out + events.finish(last)), ended


ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.incomplete",
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, len(STREAM) - 1), max_size=12), st.sampled_from([0, len(b"data: [DONE]\n\n")]))
def test_a_chat_stream_makes_the_same_events_however_it_is_cut(cuts, tail):
    events, ended = converted(STREAM, cuts, tail)
    assert [name for name, _ in events] == ORDER
    assert [d["sequence_number"] for _, d in events] == list(range(len(ORDER)))
    assert "".join(d["delta"] for name, d in events if name.endswith(".delta")) == "hello"
    final = events[-1][1]["response"]
    assert ended == [final] and final["status"] == "incomplete" and final["usage"]["input_tokens"] == 10
    assert final["output"][0]["content"][0]["text"] == "hello" and events[0][1]["response"]["status"] == "in_progress"
    item_ids = {d.get("item_id", d.get("item", {}).get("id")) for _, d in events[2:-1]}
    assert len(item_ids) == 1 and final["output"][0]["id"] in item_ids


def test_a_stream_that_stops_completes():
    events, _ = converted(STREAM.replace(b'"length"', b'"stop"'), [])
    assert events[-1][0] == "response.completed" and events[-1][1]["response"]["status"] == "completed"
    assert events[-1][1]["response"]["output"][0]["status"] == "completed"


def test_a_worker_failure_mid_stream_is_response_failed():
    error = (
        b'data: {"error": {"message": "worker w0 failed: gone", "type": "server_error", "code": "worker_failed"}}\n\n'
    )
    events, ended = converted(chunk("", role=True) + chunk("hel"), [], 0)
    assert events[-1][0] == "response.failed" and events[-1][1]["response"]["error"]["message"] == CUT_SHORT
    ended_by_error: list[dict] = []
    e = ResponseEvents(parse(), "resp_1", 7, ended_by_error.append)
    out = events_of(e.feed(chunk("", role=True) + chunk("hel")) + e.finish(error + b"data: [DONE]\n\n"))
    assert [n for n, _ in out][-2:] == ["response.output_text.delta", "response.failed"]
    final = out[-1][1]["response"]
    assert final["status"] == "failed" and final["error"] == {
        "code": "server_error",
        "message": "worker w0 failed: gone",
    }
    assert final["output"][0]["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == "hel"
    assert ended_by_error == [final] and [d["sequence_number"] for _, d in out] == list(range(len(out)))


def test_a_terminal_event_a_write_makes_waits_until_the_response_is_stored():
    """The chat relay holds a stream's last `[DONE]` for its final send (ResponseStream waits
    there), but a worker's error event, or a `[DONE]` inside a chunk, ends the response in a
    write: that chunk and any after it wait for the store's hold too."""

    async def go() -> tuple[list[bool], list[str], list[str]]:
        stored = asyncio.Event()
        events = ResponseEvents(parse(), "resp_1", 7, lambda response: asyncio.ensure_future(stored.wait()))
        client = Client()
        body = EventsBody(RawBody(client), events)
        wrote = [body.write(chunk("", role=True) + chunk("hel")), body.write(chunk("lo", "stop") + USAGE + DONE)]
        before = [n for n, _ in events_of(b"".join(c.split(b"\r\n")[1] for c in client.got))]
        stored.set()
        await body.drain()
        after = [n for n, _ in events_of(b"".join(c.split(b"\r\n")[1] for c in client.got))]
        return wrote, before, after

    wrote, before, after = asyncio.run(go())
    assert wrote == [True, False]  # the relay stops reading and drains
    assert before == ORDER[:5] and after[-1] == "response.completed" and after[:5] == before
