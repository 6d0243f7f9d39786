"""vLLM's prompt options, read by the one parser the gateway and the workers share
(workers/protocol.py, the options themselves in workers/prompt_options.py): `add_special_tokens`
(text and chat), `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`,
`reasoning_effort` and `documents` give the ids HF's own tokenizer calls give, through the
gateway's and the worker's caching tokenizers and /tokenize alike. The cases:
tests/prompt_option_cases.py."""

import pytest

from gateway.tokenize import ModelTokenizer
from tests.prompt_option_cases import (
    CHAT_CASES,
    CONVERSATION,
    CTX,
    LONG,
    MODEL,
    chat_ids,
    tok,  # noqa: F401 (a fixture)
    wire,
)
from workers.prefix_tokens import PrefixTokenizer
from workers.protocol import parse_request, tokenize_body


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


def test_an_empty_assistant_message_is_continued_from_its_start(tok, parse):
    messages = [CONVERSATION[0], {"role": "assistant", "content": ""}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    assert parse({"messages": messages, **fields}) == chat_ids(tok, fields, False, messages)


def test_an_empty_documents_list_is_passed_as_vllm_passes_it(tok, parse):
    assert parse({"messages": CONVERSATION, "documents": []}) == chat_ids(
        tok, {"add_generation_prompt": True, "documents": []}, False
    )
