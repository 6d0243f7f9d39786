"""What the prompt-option tests share (tests/test_prompt_option_ids.py,
test_prompt_option_refusals.py, test_unimplemented_vllm_fields.py, test_session_id.py,
test_prompt_options_fleet.py): a tokenizer on which every option changes the ids (`variant`, the
`tok` fixture), the conversation and options they send, the fields kvgate refuses (REFUSED), and
a body as a server reads it (`wire`), refused (`refused`) or tokenized by HF (`chat_ids`)."""

import json

import pytest

from workers.model_store import load_tokenizer
from workers.protocol import check_request, parse_request
from workers.sampling_params import InvalidRequest
from workers.strict_json import loads

MODEL = "smollm2-135m"
CTX = 8192
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
