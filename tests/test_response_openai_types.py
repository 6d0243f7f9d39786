"""The Responses API answers the gateway makes for kvgate's workers validate against the openai
package's own types (`openai.types.responses.Response` and `ResponseStreamEvent`), which the
OpenAI SDK parses them with. openai is not a dependency of the gateway: it is installed in
vLLM's venv, so the answers are made here and validated there (the test is skipped without that
venv, as tests/vllm_env.py says)."""

import json
import subprocess

from gateway.response_events import ResponseEvents
from gateway.response_object import Usage, output_message, response_json
from gateway.response_request import parse_create
from tests.vllm_env import need_vllm

MODEL = "smollm2-135m"
VALIDATE = """
import json, sys
from pydantic import TypeAdapter
from openai.types.responses import Response, ResponseStreamEvent
given = json.load(sys.stdin)
for r in given["responses"]:
    Response.model_validate(r)
events = TypeAdapter(ResponseStreamEvent)
print(json.dumps([type(events.validate_python(e)).__name__ for e in given["events"]]))
"""


def chunk(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {"content": content} if content is not None else {}
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}\n\n'


def stream_events(finish: str, tail: bytes = b"data: [DONE]\n\n") -> list[dict]:
    req = parse_create({"model": MODEL, "input": "hi", "metadata": {"k": "v"}, "max_output_tokens": 2}, MODEL)
    events = ResponseEvents(req, "resp_1", 5, lambda response: None)
    out = events.feed(chunk("he") + chunk("y", finish) + USAGE) + events.finish(tail)
    return [json.loads(e.split(b"\ndata: ", 1)[1]) for e in out.split(b"\n\n") if e]


def test_a_whole_answer_and_every_stream_event_validate_against_openais_types():
    req = parse_create({"model": MODEL, "input": "hi", "instructions": "be brief", "max_output_tokens": 2}, MODEL)
    responses = [
        response_json(req, "resp_1", 5, status, [output_message("msg_1", "hey", item)], Usage(9, 8, 2), error)
        for status, item, error in (
            ("completed", "completed", None),
            ("incomplete", "incomplete", None),
            ("failed", "incomplete", "boom"),
        )
    ]
    events = stream_events("stop") + stream_events("length")
    events += stream_events("stop", b'data: {"error": {"message": "gone"}}\n\n')
    names = [e["type"] for e in events]
    assert {"response.completed", "response.incomplete", "response.failed"} <= set(names)
    given = json.dumps({"responses": responses, "events": events})
    done = subprocess.run([need_vllm(), "-c", VALIDATE], input=given, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads(done.stdout)) == len(events)
