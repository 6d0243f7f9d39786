"""vLLM fields kvgate's workers do not implement (workers/unsupported.py): refused, a 400 naming
the field, unless at their no-op value, by the gateway's check, the worker's parse and /tokenize
alike; `parallel_tool_calls`, with tools refused, asks nothing. The cases:
tests/prompt_option_cases.py."""

import pytest

from tests.prompt_option_cases import (
    CONVERSATION,
    CTX,
    REFUSED,
    refused,
    tok,  # noqa: F401 (a fixture)
    wire,
)
from workers.protocol import parse_request, tokenize_body
from workers.sampling_params import InvalidRequest


@pytest.mark.parametrize("name, value, noop", REFUSED)
@pytest.mark.parametrize("prompt", [{"messages": CONVERSATION}, {"prompt": "hi"}], ids=["chat", "text"])
def test_tokenize_refuses_the_unimplemented_fields_the_endpoints_refuse(tok, name, value, noop, prompt):
    with pytest.raises(InvalidRequest) as e:
        tokenize_body(wire({**prompt, name: value}), tok, CTX)
    assert e.value.param == name and e.value.code == "unsupported_parameter"
    tokenize_body(wire({**prompt, name: noop}), tok, CTX)
    with pytest.raises(InvalidRequest) as e:
        tokenize_body(wire({**prompt, "model": 5}), tok, CTX)
    assert e.value.param == "model"


@pytest.mark.parametrize("name, value, noop", REFUSED)
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_unimplemented_vllm_fields_are_refused_unless_at_their_noop_value(tok, name, value, noop, kind):
    prompt = {"messages": CONVERSATION} if kind == "chat" else {"prompt": "hi"}
    for checker in (None, tok):
        e = refused({**prompt, name: value}, kind, checker)
        assert e.param == name and e.code == "unsupported_parameter"
    parse_request(wire({**prompt, name: noop}), kind, tok, CTX)


@pytest.mark.parametrize("value", [True, False])
def test_parallel_tool_calls_asks_nothing_without_tools(tok, value):
    """Tools are refused, so either value of the flag over them is a no-op; a non-boolean is not."""
    parse_request(wire({"messages": CONVERSATION, "parallel_tool_calls": value}), "chat", tok, CTX)
    assert refused({"messages": CONVERSATION, "parallel_tool_calls": 1}).param == "parallel_tool_calls"
