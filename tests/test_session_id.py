"""A request's session (the affinity key the policies read): vLLM's `session_id` is a bounded
string that changes nothing of the prompt, and the gateway reads the session from the
x-session-id header, then `session_id`, then `user`. The cases: tests/prompt_option_cases.py."""

import pytest
from starlette.requests import Request

from gateway.intake import Intake
from tests.prompt_option_cases import (
    CONVERSATION,
    CTX,
    MODEL,
    refused,
    tok,  # noqa: F401 (a fixture)
    wire,
)
from workers.protocol import MAX_SESSION_ID, parse_request


def test_a_session_id_is_a_bounded_string_that_changes_nothing_of_the_prompt(tok):
    plain = parse_request(wire({"messages": CONVERSATION}), "chat", tok, CTX).prompt_ids
    named = parse_request(wire({"messages": CONVERSATION, "session_id": "chat-7"}), "chat", tok, CTX)
    assert named.prompt_ids == plain
    for bad in (7, ["chat-7"], "s" * (MAX_SESSION_ID + 1)):
        for checker in (None, tok):
            assert refused({"messages": CONVERSATION, "session_id": bad}, tok=checker).param == "session_id"


@pytest.mark.parametrize(
    "headers, body, session",
    [
        ({}, {"session_id": "body", "user": "u"}, "body"),
        ({"x-session-id": "header"}, {"session_id": "body"}, "header"),
        ({}, {"user": "u"}, "u"),
        ({}, {}, None),
    ],
)
def test_the_gateway_reads_the_session_from_the_header_then_session_id_then_user(headers, body, session):
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    intake = Intake(None, None, None, None, None)  # type: ignore[arg-type]  # request_view reads none of them
    view = intake.request_view(Request(scope), body, "chat", MODEL, None, 100, "r")
    assert view.session_id == session
