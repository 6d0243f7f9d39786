"""Requests forwarded whole to a vLLM fleet: what the gateway still checks and how it counts them."""

import pytest

from gateway.passthrough import internal_field, parse_whole
from gateway.tokenize import ModelTokenizer
from workers.model_store import load_tokenizer
from workers.protocol import parse_request
from workers.sampling_params import InvalidRequest


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


def test_n_prompt_lists_and_vllm_only_fields_parse_and_count_every_completion(tok):
    body = {
        "prompt": ["one two three", "four five six seven"],
        "n": 3,
        "max_tokens": 5,
        "logprobs": 2,
        "truncate_prompt_tokens": 3,
    }
    first = parse_whole(body, "completion", tok, 1024)
    assert first.prompt_ids == tok.encode("one two three")
    tokens = len(tok.encode("one two three")) + len(tok.encode("four five six seven"))
    assert (first.prompt_tokens, first.num_choices) == (tokens, 6)
    m = ModelTokenizer("smollm2-135m", tok, 16)
    prep = m.prepare(body, "completion", 1024, whole=True)
    assert (prep.num_tokens, prep.max_tokens) == (tokens, 5 * 6)
    with pytest.raises(InvalidRequest) as e:
        m.prepare(body, "completion", 1024)  # kvgate's own workers take n, lists, logprobs, not this
    assert e.value.param == "truncate_prompt_tokens"
    del body["truncate_prompt_tokens"]
    assert m.prepare(body, "completion", 1024).max_tokens == 5 * 6


def test_a_single_request_parses_as_kvgate_parses_it(tok):
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_tokens": 3,
    }
    first = parse_whole(body, "chat", tok, 1024)
    assert first == parse_request(body, "chat", tok, 1024) and first.num_choices == 1
    ids = parse_whole({"prompt": [[1, 2, 3], [4, 5]]}, "completion", tok, 1024)
    assert (ids.prompt_tokens, ids.num_choices) == (5, 2)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 1.5}, "n"),
        ({"prompt": "x", "n": 10_000}, "n"),
        ({"prompt": ["x", ""]}, "prompt"),
        ({"prompt": ["x"] * 2000}, "prompt"),
        ({"prompt": ["x", "y " * 5000]}, "prompt"),  # every prompt meets the context limit
        ({"prompt": "x", "temperature": -1}, "temperature"),  # fields kvgate knows are still checked
    ],
)
def test_what_the_gateway_still_refuses(tok, body, param):
    with pytest.raises(InvalidRequest) as e:
        parse_whole(body, "completion", tok, 1024)
    assert e.value.param == param


def test_fields_that_steer_vllms_cache_are_internal():
    assert internal_field({"kv_transfer_params": {}}) == "kv_transfer_params"
    assert internal_field({"ec_transfer_params": {"do_remote_encode": True}}) == "ec_transfer_params"
    assert internal_field({"kv_transfer": {}}) == "kv_transfer"
    assert internal_field({"vllm_xargs": {"kv_cache_report_mode": "full"}}) == "vllm_xargs"
    assert internal_field({"vllm_xargs": {"my_logits_processor": 1}, "n": 2}) is None


@pytest.mark.parametrize(
    "field,value",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_object"}),
        ("structured_outputs", {"choice": ["yes", "no"]}),
        ("use_beam_search", True),
        ("chat_template", "{{ messages[0].content }}"),
        ("vllm_xargs", {"my_logits_processor": 1}),
        ("thinking_token_budget", 16),
    ],
)
def test_fields_only_vllm_implements_pass_to_vllm_and_are_refused_for_kvgate_workers(tok, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, field: value}
    m = ModelTokenizer("smollm2-135m", tok, 16)
    assert (
        m.prepare(body, "chat", 1024, whole=True).parsed.prompt_ids
        == parse_request({k: v for k, v in body.items() if k != field}, "chat", tok, 1024).prompt_ids
    )
    with pytest.raises(InvalidRequest) as e:
        m.prepare(body, "chat", 1024)
    assert e.value.param == field and e.value.code == "unsupported_parameter" and "vLLM" in str(e.value)


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", "0.5"),  # pydantic's lax mode: a numeric string, a boolean
        ("frequency_penalty", True),
        ("repetition_penalty", "1.1"),
        ("min_p", "0.05"),
        ("min_tokens", "2"),
        ("logit_bias", {str(t): 1 for t in range(2000)}),  # no key limit in vLLM's reader
        ("include_stop_str_in_output", "true"),
        ("skip_special_tokens", 0),
        ("spaces_between_special_tokens", "no"),
        ("allowed_token_ids", ["5", 6.0, True]),
        ("allowed_token_ids", [7] * 2000),  # vLLM's V1 runner takes any number
        ("bad_words", [" ".join(["x"] * 600)]),  # 1,200 tokens with its spaced form: V1 takes them
    ],
)
def test_sampling_controls_go_to_vllm_as_sent_and_kvgate_workers_read_them_strictly(tok, field, value):
    """A vLLM fleet's request takes the sampling controls as vLLM reads them (they were left to it
    while kvgate's workers refused them, and still are); kvgate's own workers keep their stricter
    reader, a 400 naming the field."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, field: value}
    m = ModelTokenizer("smollm2-135m", tok, 16)
    whole = m.prepare(body, "chat", 1024, whole=True).parsed
    assert (
        whole.prompt_ids == parse_request({k: v for k, v in body.items() if k != field}, "chat", tok, 1024).prompt_ids
    )
    with pytest.raises(InvalidRequest) as e:
        m.prepare(body, "chat", 1024)
    assert e.value.param == field
