"""vLLM's prompt options, read by the one parser the gateway and the workers share
(workers/protocol.py, the options themselves in workers/prompt_options.py): `add_special_tokens`
(text and chat), `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` give
the ids HF's own tokenizer calls give, through the gateway's and the worker's caching tokenizers,
/tokenize and `kv_prompt_ids` alike; each refused shape is a 400 naming its field, and vLLM fields
kvgate does not implement are refused unless at their no-op value."""

import inspect
import json

import httpx
import pytest

from starlette.requests import Request

from gateway.intake import Intake
from gateway.procs import Worker, start_gateway, stop_all
from gateway.tokenize import ModelTokenizer
from workers.model_store import load_tokenizer, served_name
from workers.prefix_tokens import PrefixTokenizer
from workers.protocol import MAX_SESSION_ID, check_request, parse_request, tokenize_body
from workers.sampling_params import InvalidRequest
from workers.strict_json import MAX_DEPTH, loads

MODEL = "smollm2-135m"
CTX = 8192
TOKEN = "prompt-options-token"
# Qwen3's switch: with `enable_thinking: false` the template writes an empty thinking block.
THINKING = "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
# What gpt-oss's template does with `reasoning_effort`, and a RAG template's `documents`.
EFFORT = "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
DOCUMENTS = "{% if documents is not none %}<docs>{% for d in documents %}{{ d.title }}: {{ d.text }}\n{% endfor %}</docs>{% endif %}"
DOCS = [
    {"title": "Blocks", "text": "The cache keeps full blocks."},
    {"title": "Hashes", "text": "Each block is hashed."},
]
LONG = "The cache holds the prefix of the prompt, block by block, for the next request. " * 24
CONVERSATION = [
    {"role": "user", "content": LONG + "Say it in one line."},
    {"role": "assistant", "content": "The cache keeps"},
]
# (request fields, apply_chat_template's arguments, encode's add_special_tokens)
CHAT_CASES = {
    "add_generation_prompt": ({"add_generation_prompt": False}, {"add_generation_prompt": False}, False),
    "continue_final_message": (
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_generation_prompt": False, "continue_final_message": True},
        False,
    ),
    "add_special_tokens": ({"add_special_tokens": True}, {"add_generation_prompt": True}, True),
    "chat_template_kwargs": (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"add_generation_prompt": True, "enable_thinking": False},
        False,
    ),
    "reasoning_effort": (  # vLLM: the effort, and thinking on unless it is "none"
        {"reasoning_effort": "none"},
        {"add_generation_prompt": True, "reasoning_effort": "none", "enable_thinking": False},
        False,
    ),
    "reasoning_effort and chat_template_kwargs": (  # vLLM: the field's effort, the client's switch
        {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "high"}},
        {"add_generation_prompt": True, "reasoning_effort": "low", "enable_thinking": False},
        False,
    ),
    "documents": ({"documents": DOCS}, {"add_generation_prompt": True, "documents": DOCS}, False),
}
REFUSED = [  # (field, a value that asks for something, its no-op value)
    ("priority", 1, 0),
    ("prompt_embeds", "AAAAAA==", None),
    ("length_penalty", 0.5, 1.0),
    ("truncation_side", "left", None),
    ("logprob_token_ids", [1, 2], None),
    ("chat_template", "{{ messages[0].content }}", None),
    ("mm_processor_kwargs", {"num_crops": 4}, {}),
    ("media_io_kwargs", {"video": {"num_frames": 8}}, {}),
    ("thinking_token_budget", 64, -1),
    ("include_reasoning", False, True),
    ("watermarking", True, False),
    ("repetition_detection", {"max_pattern_size": 4}, None),
    ("spaces_between_special_tokens", False, True),
    ("return_tokens_as_token_ids", True, False),
    ("return_prompt_text", True, False),
    ("routed_experts_prompt_start", 3, 0),
    ("stream_interval", 8, 1),
    ("vllm_xargs", {"my_logits_processor": 1}, {}),
    ("kv_transfer_params", {"do_remote_decode": True}, None),
    ("ec_transfer_params", {"do_remote_encode": True}, None),
]


def variant():
    """SmolLM2's tokenizer adding a BOS token (as Llama's do) under a template that reads
    `enable_thinking` (as Qwen3's does), `reasoning_effort` and `documents`: so every option
    changes the ids."""
    tok = load_tokenizer(MODEL)
    tok.add_bos_token = True
    tok.chat_template = DOCUMENTS + tok.chat_template + EFFORT + THINKING
    return tok


@pytest.fixture(scope="module")
def tok():
    t = variant()
    assert t.encode("hi")[0] == t.bos_token_id != t.encode("hi", add_special_tokens=False)[0]
    return t


@pytest.fixture(scope="module", params=["tokenizer", "worker", "gateway"])
def parse(request, tok):
    """parse_request's first prompt ids through HF's tokenizer itself, the worker's prefix cache,
    or the gateway's prefix and word caches (its own `prepare`); each body parsed twice, the
    second read from the caches."""
    if request.param == "gateway":
        model = ModelTokenizer(MODEL, tok, 16)
        assert model.tokenizer.enabled and model.tokenizer.words is not None

        def run(body: dict, kind: str) -> list[int]:
            return model.prepare(wire(body), kind, CTX).parsed.prompt_ids
    else:
        wrapped = tok if request.param == "tokenizer" else PrefixTokenizer(tok, words=False)
        assert request.param == "tokenizer" or wrapped.enabled

        def run(body: dict, kind: str) -> list[int]:
            return parse_request(wire(body), kind, wrapped, CTX).prompt_ids

    def twice(body: dict, kind: str = "chat") -> list[int]:
        first = run(body, kind)
        assert run(body, kind) == first
        return first

    return twice


def wire(body: dict) -> object:
    """The body as a server reads it."""
    return loads(json.dumps({"model": MODEL, "max_tokens": 4, **body}).encode())


def refused(body: dict, kind: str = "chat", tok=None) -> InvalidRequest:
    """The 400 the parse (with a tokenizer, or the gateway's check without one) gives `body`."""
    with pytest.raises(InvalidRequest) as e:
        if tok is None:
            check_request(wire(body), kind)
        else:
            parse_request(wire(body), kind, tok, CTX)
    return e.value


def chat_ids(tok, template_args: dict, special: bool, messages: list[dict] = CONVERSATION) -> list[int]:
    """What HF's tokenizer makes of the conversation with these options."""
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, **template_args), add_special_tokens=special)


# -- the ids are HF's own -------------------------------------------------------------------------


def test_add_special_tokens_on_a_text_prompt(tok, parse):
    assert parse({"prompt": LONG}, "completion") == tok.encode(LONG)
    assert parse({"prompt": LONG, "add_special_tokens": True}, "completion") == tok.encode(LONG)
    assert parse({"prompt": LONG, "add_special_tokens": False}, "completion") == tok.encode(
        LONG, add_special_tokens=False
    )


@pytest.mark.parametrize("case", CHAT_CASES)
def test_chat_options_give_apply_chat_templates_ids(tok, parse, case):
    fields, template_args, special = CHAT_CASES[case]
    want = chat_ids(tok, template_args, special)
    assert want != chat_ids(tok, {"add_generation_prompt": True}, False), "the option changes the prompt"
    assert parse({"messages": CONVERSATION, **fields}) == want


@pytest.mark.parametrize("case", ["continue_final_message", "chat_template_kwargs", "reasoning_effort", "documents"])
def test_tokenize_reads_the_options_as_the_chat_endpoint_does(tok, case):
    fields, template_args, special = CHAT_CASES[case]
    ids, _ = tokenize_body(wire({"messages": CONVERSATION, **fields}), PrefixTokenizer(tok, words=False), CTX)
    assert ids == chat_ids(tok, template_args, special)


def test_tokenize_refuses_what_the_endpoints_refuse(tok):
    for body, param in [
        ({"messages": CONVERSATION, "continue_final_message": True}, "continue_final_message"),
        ({"messages": CONVERSATION, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            tokenize_body(wire(body), tok, CTX)
        assert e.value.param == param


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


def test_an_empty_assistant_message_is_continued_from_its_start(tok, parse):
    messages = [CONVERSATION[0], {"role": "assistant", "content": ""}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    assert parse({"messages": messages, **fields}) == chat_ids(tok, fields, False, messages)


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


def test_an_empty_documents_list_is_passed_as_vllm_passes_it(tok, parse):
    assert parse({"messages": CONVERSATION, "documents": []}) == chat_ids(
        tok, {"add_generation_prompt": True, "documents": []}, False
    )


# -- vLLM fields kvgate's workers do not implement ------------------------------------------------


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


def test_a_requests_own_chat_template_is_refused_as_vllm_refuses_an_untrusted_one(tok):
    for fields in ({"chat_template": "{{ 'x' }}"}, {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}):
        for checker in (None, tok):
            e = refused({"messages": CONVERSATION, **fields}, tok=checker)
            assert e.param in fields and "chat_template" in str(e)
    assert "--trust-request-chat-template" in str(refused({"messages": CONVERSATION, "chat_template": "{{ 'x' }}"}))


# -- through a gateway sending its ids to a worker ------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A sim worker and a gateway (both with the fleet's token, so the gateway sends its ids,
    `kv_prompt_ids`) serving the BOS-adding, thinking-template tokenizer from its own folder."""
    folder = tmp_path_factory.mktemp("smollm2-options")
    variant().save_pretrained(folder)
    w = Worker(worker_id="po0", model=str(folder), extra=["--internal-token", TOKEN])
    g = start_gateway([w.url], name="gw-options", extra=["--internal-token", TOKEN, "--model", str(folder)])
    try:
        w.ready()
        g.wait_ready()
        g.wait_healthy(1, what="the worker")
        yield w, g, served_name(str(folder))
    finally:
        stop_all([g, w])


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_through_the_gateway_the_worker_counts_the_prompt_as_it_does_alone(fleet, tok):
    w, g, model = fleet
    chat = "/v1/chat/completions"
    cases = [
        ("/v1/completions", {"prompt": LONG, "add_special_tokens": False}, tok.encode(LONG, add_special_tokens=False)),
        *[
            (chat, {"messages": CONVERSATION, **fields}, chat_ids(tok, args, special))
            for fields, args, special in CHAT_CASES.values()
        ],
    ]

    def tokenized(by: str) -> float:
        return w.metric("kvgate_worker_prompts_tokenized_total", by=by)

    for path, fields, want in cases:
        body = {"model": model, "max_tokens": 2, **fields}
        before = tokenized("gateway")
        alone, routed = post(w.url, path, body), post(g.url, path, body)
        assert alone.status_code == routed.status_code == 200, (alone.text, routed.text)
        assert alone.json()["usage"]["prompt_tokens"] == routed.json()["usage"]["prompt_tokens"] == len(want), fields
        assert tokenized("gateway") == before + 1, "the worker took the gateway's ids"
        if path == chat:
            r = post(w.url, "/tokenize", {"model": model, **fields})
            assert r.status_code == 200 and r.json()["tokens"] == want


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"note": "a" * 20000}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"add_special_tokens": "yes"}, "add_special_tokens"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"documents": [{"title": 5}]}, "documents"),
        *[({name: value}, name) for name, value, _ in REFUSED],
    ],
)
def test_refusals_are_400s_naming_the_field_at_the_gateway_and_the_worker(fleet, fields, param):
    w, g, model = fleet
    for url in (g.url, w.url):
        r = post(url, "/v1/chat/completions", {"model": model, "messages": CONVERSATION, "max_tokens": 2, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
