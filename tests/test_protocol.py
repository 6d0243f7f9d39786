"""The shared request parse (gateway and worker) against hostile and unusual-but-valid bodies:
every outcome is a ParsedRequest or an InvalidRequest (a 400), never another exception."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.model_store import load_tokenizer
from workers.prompt_length import _LAST_CUT, token_chars
from workers.protocol import check_request, parse_request
from workers.sampling_params import InvalidRequest, SamplingParams
from workers.strict_json import MAX_DEPTH, loads

MODEL = "smollm2-135m"
CTX = 1024


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def parse(tok, body: dict, kind: str = "completion", vocab_size: int | None = None):
    return parse_request(loads(json.dumps(body).encode()), kind, tok, CTX, vocab_size)


def refused(tok, body, kind: str = "completion", vocab_size: int | None = None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        parse_request(body, kind, tok, CTX, vocab_size)
    return e.value


def chat_text(tok, messages: list[dict]) -> str:
    return tok.decode(parse(tok, {"messages": messages, "max_tokens": 1}, "chat").prompt_ids)


# -- JSON as a hostile client sends it ------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "top_p": Infinity}',
        b'{"prompt": "x", "top_p": -Infinity}',
        b'{"max_tokens": ' + b"9" * 5000 + b"}",
        b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"x": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}",
        b'{"prompt": "a\\ud800b"}',
        b'{"\\udfff": 1}',
        b'{"prompt": "\xed\xa0\x80"}',
        b"\xff\xfe{}",
        b"{not json",
        b"",
    ],
)
def test_loads_refuses_what_json_does_not_allow_as_a_client_error(raw):
    with pytest.raises(InvalidRequest):
        loads(raw)


def test_loads_keeps_valid_unicode_and_ordinary_nesting():
    assert loads('{"p": "\\ud83d\\ude00 ✓"}'.encode()) == {"p": "\U0001f600 ✓"}
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(b'{"x": ' + nested[1:-1].encode() + b"}")
    assert loads(b'{"messages": [' + b",".join([b'{"role": "user", "content": "hi"}'] * 200) + b"]}")


# -- chat messages as OpenAI clients send them -----------------------------------------------------


def test_content_as_a_list_of_parts_is_flattened_like_vllm(tok):
    parts = [
        {"type": "text", "text": "first"},
        "second",
        {"type": "input_text", "text": "third"},
        {"type": "text", "text": None},
        {"type": "refusal", "refusal": "no"},
    ]
    plain = chat_text(tok, [{"role": "user", "content": "first\nsecond\nthird\nno"}])
    assert chat_text(tok, [{"role": "user", "content": parts}]) == plain


def test_assistant_tool_calls_without_content_and_tool_roles_render(tok):
    calls = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    text = chat_text(
        tok,
        [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
            {"role": "function", "name": "weather", "content": "12 C"},
        ],
    )
    assert "<|im_start|>assistant\n<|im_end|>" in text
    assert "<|im_start|>tool\n12 C<|im_end|>" in text and "<|im_start|>developer\nbe brief" in text


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        [{"content": "no role"}],
        [{"role": 5, "content": "x"}],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": {"text": "x"}}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        [{"role": "user", "content": [{"text": "no type"}]}],
        [{"role": "user", "content": [{"type": ["text"]}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [{"role": "user", "content": "x", "name": 5}],
        [{"role": "user", "content": "x", "tool_calls": []}],
        [{"role": "assistant", "tool_calls": "call"}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": 7, "arguments": "{}"}}]}],
    ],
)
def test_malformed_messages_are_400s(tok, messages):
    assert refused(tok, {"messages": messages, "max_tokens": 1}, "chat").param == "messages"


def test_a_template_that_raises_is_the_clients_error():
    class Strict:
        def apply_chat_template(self, messages, **kw):
            from jinja2 import TemplateError

            raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    with pytest.raises(InvalidRequest, match="alternate"):
        parse_request({"messages": [{"role": "user", "content": "x"}]}, "chat", Strict(), CTX)


# -- sampling parameters: ranges and types ---------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("max_tokens", "8"),
        ("max_tokens", True),
        ("max_tokens", 10**309),
        ("max_tokens", 1e300),
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("temperature", 10**400),
        ("top_p", 0),
        ("top_p", 1.01),
        ("top_p", [0.5]),
        ("top_k", 10**309),
        ("top_k", -2),
        ("top_k", 2**31),
        ("top_k", 0.5),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("seed", 1.5),
        ("stop", 5),
        ("stop", [""]),
        ("stop", ["x"] * 33),
        ("stop", ["x" * 1025]),
        ("stop", [1]),
        ("stop_token_ids", [2**31]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", list(range(1025))),
        ("ignore_eos", "yes"),
        ("stream", 1),
        ("stream_options", []),
        ("stream_options", {"include_usage": "y"}),
        ("return_token_ids", "no"),
        ("n", 0),
        ("n", 129),
        ("n", "1"),
        ("user", 5),
        ("model", ["m"]),
        ("presence_penalty", 2.5),
        ("presence_penalty", True),
        ("frequency_penalty", math.inf),
        ("frequency_penalty", -2.01),
        ("logprobs", 21),
        ("logprobs", True),
        ("logprobs", -1),
        ("echo", "yes"),
        ("best_of", 3),
        ("logit_bias", {"x": 5}),
        ("logit_bias", {"1": "5"}),
        ("logit_bias", {"-1": 5}),
        ("logit_bias", [[1, 5]]),
        ("logit_bias", {str(i): 1 for i in range(1025)}),
        ("tools", [{"type": "function"}]),
        ("response_format", {"type": "json_object"}),
        ("min_tokens", 4),  # more than max_tokens
        ("min_tokens", -1),
        ("min_tokens", 1.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.2),
        ("repetition_penalty", "1.2"),
        ("min_p", 1.01),
        ("min_p", -0.1),
        ("kv_transfer", {"export_to": "ftp://x"}),
        ("kv_transfer", {"wait_ms": 10**9}),
        ("kv_transfer", "x"),
    ],
)
def test_every_field_is_type_and_range_checked(tok, field, value):
    assert refused(tok, {"prompt": "hello", "max_tokens": 2, field: value}).param == field


def test_defaults_and_no_op_values_of_unsupported_fields_pass(tok):
    p = parse(
        tok,
        {
            "prompt": "hello",
            "max_tokens": 3,
            "top_k": -1,
            "seed": -(2**63),
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logprobs": None,
            "echo": False,
            "n": 1,
            "best_of": 1,
            "logit_bias": {},
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "stream": False,
            "stream_options": None,
            "user": "u1",
            "stop": ["\n"],
            "temperature": 0,
        },
    )
    assert p.params.top_k == 0 and p.params.seed == -(2**63) and p.params.max_tokens == 3 and p.params.greedy


def test_worker_vocab_bounds_token_ids(tok):
    assert refused(tok, {"prompt": [5, 49152], "max_tokens": 1}, vocab_size=49152).param == "prompt"
    assert refused(tok, {"prompt": "x", "stop_token_ids": [49152]}, vocab_size=49152).param == "stop_token_ids"
    assert parse(tok, {"prompt": [5, 10**9], "max_tokens": 1}).prompt_ids == [5, 10**9]  # the gateway: int32


def test_extreme_valid_sampling_params_do_not_break_the_sampler():
    torch = pytest.importorskip("torch")
    from workers.sampling import sample

    logits = torch.randn(6, 50)
    params = [
        SamplingParams(temperature=1e-300),
        SamplingParams(temperature=1.7e308),
        SamplingParams(top_k=2**31 - 1),
        SamplingParams(top_p=5e-324),
        SamplingParams(seed=-(2**63)),
        SamplingParams(seed=2**63 - 1, top_k=1),
    ]
    for p in params:
        p.validate()
    tokens = sample(logits, params, [0, 1, 2, 3, 4, 5])
    assert all(0 <= t < 50 for t in tokens)


def test_check_request_is_parse_request_without_the_tokenizer(tok):
    check_request({"prompt": [1, 2], "max_tokens": 2}, "completion")
    check_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, "chat")
    for body, kind in (
        ({"prompt": "x", "top_k": 10**309}, "completion"),
        ({"prompt": ""}, "completion"),
        ({"messages": [{"role": "user", "content": 1}]}, "chat"),
        ([], "chat"),
    ):
        with pytest.raises(InvalidRequest):
            check_request(body, kind)


# -- prompt length before tokenization -------------------------------------------------------------


def test_a_prompt_far_too_long_is_refused_without_tokenizing_it(tok):
    class Counting:
        """The real tokenizer, counting the characters it is asked to encode."""

        def __init__(self):
            self.chars = 0

        def get_vocab(self):
            return tok.get_vocab()

        backend_tokenizer = tok.backend_tokenizer

        def encode(self, text, **kw):
            self.chars += len(text)
            return tok.encode(text, **kw)

        def apply_chat_template(self, messages, **kw):
            return tok.apply_chat_template(messages, **kw)

    counting = Counting()
    too_many_chars = "x" * (token_chars(tok) * CTX + 1)  # past the bound: no tokenizing at all
    err = refused(counting, {"prompt": too_many_chars})
    assert err.code == "context_length_exceeded" and counting.chars == 0
    prose = "the cache holds blocks of tokens " * 2000  # 66k characters: under the bound, ~14k tokens
    assert len(prose) < token_chars(tok) * CTX
    assert refused(counting, {"prompt": prose}).code == "context_length_exceeded"
    assert 0 < counting.chars <= 8 * CTX  # only a prefix was tokenized
    chat = refused(counting, {"messages": [{"role": "user", "content": prose}]}, "chat")
    assert chat.code == "context_length_exceeded" and chat.param == "messages"


def test_a_long_prompt_that_fits_is_tokenized_whole(tok):
    sparse = ("\n" + " " * 79 + "word") * 150  # 12,600 characters, 450 tokens
    assert len(sparse) > 8 * CTX
    assert parse(tok, {"prompt": sparse, "max_tokens": 1}).prompt_ids == tok.encode(sparse)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(st.sampled_from(list("ab Z9.,\n\t é✓日-'")), min_size=2, max_size=300), st.integers(1, 300))
def test_a_prefix_cut_before_a_word_tokenizes_into_a_prefix_of_the_tokens(tok, text, end):
    """Why the early refusal is sound: the prefix's tokens start the full text's tokens."""
    cut = _LAST_CUT.match(text, 0, end)
    if cut is not None:
        prefix = tok.encode(text[: cut.start(1)], add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False)[: len(prefix)] == prefix


# -- fuzz: any JSON body -> a ParsedRequest or a 400 -----------------------------------------------

_leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300, max_value=10**310)
    | st.floats(allow_nan=False, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["user", "assistant", "tool", "text", "function", ""])
)
_json = st.recursive(
    _leaf,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "tool_calls", "function", "name", "arguments", "x"]),
            kids,
            max_size=4,
        )
    ),
    max_leaves=12,
)
_fields = st.sampled_from(
    [
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_options",
        "n",
        "user",
        "ignore_eos",
        "return_token_ids",
        "logprobs",
        "tools",
        "model",
        "kv_transfer",
    ]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_fields, _json, max_size=6), st.sampled_from(["chat", "completion"]))
def test_fuzzed_bodies_parse_or_are_400s(tok, body, kind):
    base = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    raw = json.dumps({**base, **body}).encode()  # 1e999-style infinities reach loads as Infinity
    try:
        p = parse_request(loads(raw), kind, tok, CTX, 49152)
    except InvalidRequest as e:
        assert str(e)
        return
    assert 0 < len(p.prompt_ids) < CTX and p.params.max_tokens >= 1


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 66), min_size=1, max_size=4),
    st.one_of(st.none(), st.integers(1, 80)),
    st.integers(0, 30),
    st.one_of(st.none(), st.integers(1, 40)),
)
def test_a_budget_past_the_context_is_cut_to_it_as_vllm_032_does(lengths, asked, min_tokens, cap):
    """vLLM 0.32: a prompt must leave room for one token; a budget past the whole context is a
    400; otherwise the budget is what the context leaves (each prompt's, so a completion's
    choices share the shortest's and a longer one stops at the context), under the operator's
    cap; `min_tokens` must fit the longest prompt's budget."""
    from workers.generation_defaults import GenerationDefaults

    limit = 64
    body = {"model": "m", "prompt": [[7] * n for n in lengths], "min_tokens": min_tokens}
    if asked is not None:
        body["max_tokens"] = asked
    defaults = GenerationDefaults(max_tokens=cap, max_tokens_cap=cap)
    want = 16 if asked is None else asked
    if max(lengths) >= limit or want > limit and asked is not None:
        with pytest.raises(InvalidRequest) as e:
            parse_request(body, "completion", None, limit, defaults=defaults)
        assert e.value.code == "context_length_exceeded"
        return
    want = want if cap is None else min(want, cap)
    if min_tokens > min(want, limit - max(lengths)):
        with pytest.raises(InvalidRequest, match="min_tokens"):
            parse_request(body, "completion", None, limit, defaults=defaults)
        return
    parsed = parse_request(body, "completion", None, limit, defaults=defaults)
    assert parsed.params.max_tokens == min(want, limit - min(lengths))


def test_a_request_is_charged_its_budget_as_asked_not_as_cut_to_the_context(tok):
    """The gateway parses by the smallest context of a model's workers, but a worker with a
    larger one generates what was asked: the key is charged that (the policies predict by the
    cut budget, which this gateway's context allows)."""
    from gateway.tokenize import Prepared

    body = {"model": "m", "prompt": [[7] * 10, [7] * 1000], "max_tokens": 500, "n": 2}
    prep = Prepared(parse_request(body, "completion", tok, 1024), [])
    assert prep.parsed.params.max_tokens == 500 and prep.max_tokens == 2000
    cut = Prepared(parse_request(body | {"prompt": [[7] * 600]}, "completion", tok, 1024), [])
    assert cut.max_tokens == 2 * 424 and cut.asked_tokens == 2 * 500
