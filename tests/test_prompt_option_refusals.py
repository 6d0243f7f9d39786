"""vLLM's prompt options a client sends wrong, each a 400 naming its field, from the gateway's
check (no tokenizer) and the worker's parse alike, and from /tokenize: `continue_final_message`
without an assistant's message to continue or with a generation prompt, options that are not
booleans, chat options on a text prompt, and `chat_template_kwargs`, `reasoning_effort`,
`documents` or a request's own chat template from a hostile client. The cases:
tests/prompt_option_cases.py."""

import inspect
import json

import pytest

from tests.prompt_option_cases import (
    CONVERSATION,
    CTX,
    DOCS,
    MODEL,
    refused,
    tok,  # noqa: F401 (a fixture)
    wire,
)
from workers.protocol import parse_request, tokenize_body
from workers.sampling_params import InvalidRequest
from workers.strict_json import MAX_DEPTH, loads


def test_tokenize_refuses_what_the_endpoints_refuse(tok):
    for body, param in [
        ({"messages": CONVERSATION, "continue_final_message": True}, "continue_final_message"),
        ({"messages": CONVERSATION, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            tokenize_body(wire(body), tok, CTX)
        assert e.value.param == param


# -- continue_final_message as vLLM takes it ------------------------------------------------------


@pytest.mark.parametrize(
    "fields, messages",
    [
        ({"continue_final_message": True}, CONVERSATION),  # add_generation_prompt defaults to true
        ({"continue_final_message": True, "add_generation_prompt": True}, CONVERSATION),
        ({"continue_final_message": True, "add_generation_prompt": False}, CONVERSATION[:1]),
    ],
)
def test_continue_final_message_needs_the_assistants_message_and_no_generation_prompt(tok, fields, messages):
    for checker in (None, tok):
        assert refused({"messages": messages, **fields}, tok=checker).param == "continue_final_message"


# -- types and what a text prompt cannot take -----------------------------------------------------


@pytest.mark.parametrize("name", ["add_special_tokens", "add_generation_prompt", "continue_final_message"])
@pytest.mark.parametrize("value", ["true", 1, 0, [], {}])
def test_the_options_are_booleans(tok, name, value):
    for checker in (None, tok):
        assert refused({"messages": CONVERSATION, name: value}, tok=checker).param == name
    assert refused({"prompt": "hi", name: value}, "completion", tok).param == name


@pytest.mark.parametrize(
    "name, value",
    [
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("chat_template_kwargs", {"a": 1}),
        ("reasoning_effort", "low"),
        ("documents", DOCS),
        ("documents", []),
    ],
)
def test_a_text_prompt_refuses_the_chat_options_unless_at_their_default(tok, name, value):
    e = refused({"prompt": "hi", name: value}, "completion", tok)
    assert e.param == name and e.code == "unsupported_parameter"
    default = {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "chat_template_kwargs": {},
        "reasoning_effort": None,
        "documents": None,
    }[name]
    for noop in (default, None):
        assert parse_request(wire({"prompt": "hi", name: noop}), "completion", tok, CTX).prompt_ids == tok.encode("hi")


# -- chat_template_kwargs from a hostile client ----------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [[], ["enable_thinking"], "enable_thinking", 5, True, {"tokenize": True}, {"chat_template": "{{ 7 }}"}],
    ids=repr,
)
def test_chat_template_kwargs_must_be_an_object_of_template_variables(tok, value):
    for checker in (None, tok):
        assert refused({"messages": CONVERSATION, "chat_template_kwargs": value}, tok=checker).param == (
            "chat_template_kwargs"
        )


def test_chat_template_kwargs_may_not_set_apply_chat_templates_own_parameters(tok):
    names = {
        p.name
        for p in inspect.signature(tok.apply_chat_template).parameters.values()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    assert {"tokenize", "add_generation_prompt", "continue_final_message", "chat_template", "tools"} <= names
    for name in sorted(names | {"messages", "conversations"}):
        e = refused(
            {"messages": CONVERSATION, "chat_template_kwargs": {name: False, "enable_thinking": False}}, tok=tok
        )
        assert e.param == "chat_template_kwargs" and name in str(e), name


def test_chat_template_kwargs_are_bounded(tok):
    for value in ({"note": "a" * 20000}, {f"k{i}": i for i in range(3000)}, {"x": [["deep"] * 200] * 20}):
        assert (
            refused({"messages": CONVERSATION, "chat_template_kwargs": value}, tok=tok).param == "chat_template_kwargs"
        )
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    raw = json.dumps({"model": MODEL, "messages": CONVERSATION, "chat_template_kwargs": {"x": 1}}).replace(
        "1}", nested + "}"
    )
    with pytest.raises(InvalidRequest):
        loads(raw.encode())


# -- reasoning_effort and documents from a hostile client ------------------------------------------


@pytest.mark.parametrize("value", ["extreme", "LOW", "", 1, True, ["low"], {"effort": "low"}], ids=repr)
def test_reasoning_effort_is_one_of_vllms_efforts(tok, value):
    for checker in (None, tok):
        assert refused({"messages": CONVERSATION, "reasoning_effort": value}, tok=checker).param == "reasoning_effort"


@pytest.mark.parametrize(
    "value",
    [
        "the cache",
        {"title": "A", "text": "b"},
        ["the cache"],
        [{"title": "A", "text": 5}],
        [{"title": "A", "text": None}],
        [{"title": "A", "text": ["b"]}],
        [{"title": "A"}] * 257,  # more documents than any RAG prompt sends
        [{"text": "cache " * 90_000}],  # more text than MAX_DOCUMENTS_CHARS
        [{"title": "A", "text": "b" * 300_000}, {"title": "B", "text": "c" * 300_000}],
    ],
    ids=lambda v: repr(v)[:40],
)
def test_documents_are_a_bounded_list_of_objects_of_strings(tok, value):
    for checker in (None, tok):
        assert refused({"messages": CONVERSATION, "documents": value}, tok=checker).param == "documents"


def test_a_requests_own_chat_template_is_refused_as_vllm_refuses_an_untrusted_one(tok):
    for fields in ({"chat_template": "{{ 'x' }}"}, {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}):
        for checker in (None, tok):
            e = refused({"messages": CONVERSATION, **fields}, tok=checker)
            assert e.param in fields and "chat_template" in str(e)
    assert "--trust-request-chat-template" in str(refused({"messages": CONVERSATION, "chat_template": "{{ 'x' }}"}))
