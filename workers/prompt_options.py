"""How a request's prompt becomes the text to tokenize, as vLLM reads the request: the prompt
options (`add_special_tokens`; for chat messages the template's `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, `reasoning_effort` and `documents`), checked
once, and the text they make.

Pure (no torch): the gateway and the workers read a body's options by this one code, so both
tokenize a prompt into the same ids.
"""

from dataclasses import dataclass
from typing import cast

from workers.chat_template import ChatOptions, reasoning_kwargs, render_chat, template_documents, template_kwargs
from workers.fields import flag, json_equal
from workers.sampling_params import InvalidRequest

# The chat fields, at the value that asks a text prompt for nothing (chat_options's defaults).
CHAT_ONLY = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template_kwargs": {},
    "reasoning_effort": None,
    "documents": None,
}


@dataclass(frozen=True)
class PromptOptions:
    """How a prompt becomes token ids, as vLLM reads a request: `add_special_tokens` puts the
    tokenizer's own special tokens (BOS, ...) around the text; `chat`, for chat messages, is
    how the template renders them (None: a text prompt)."""

    add_special_tokens: bool
    chat: ChatOptions | None = None


def prompt_text(prompt: str | list[dict], tokenizer, options: PromptOptions) -> str:
    """The text to tokenize: chat messages through the chat template as `options.chat` asks,
    a text prompt as it is."""
    if options.chat is None:
        return cast(str, prompt)
    return render_chat(cast(list[dict], prompt), tokenizer, options.chat)


def prompt_options(body: dict, kind: str, messages: list[dict] | None = None) -> PromptOptions:
    """The body's prompt options, checked, with vLLM's defaults: `add_special_tokens` true for
    text, false for chat (its template writes them); chat's by `chat_options`, on its checked
    `messages`. A text prompt refuses the chat fields unless at their default (CHAT_ONLY): it
    has no template to ask them of."""
    special = flag(body, "add_special_tokens", default=kind != "chat")
    if kind == "chat":
        return PromptOptions(special, chat_options(body, messages or []))
    for name, noop in CHAT_ONLY.items():
        v = body.get(name)
        if v is not None and not json_equal(v, noop):
            raise InvalidRequest(f"'{name}' applies to chat messages only", name, "unsupported_parameter")
    return PromptOptions(special)


def chat_options(body: dict, messages: list[dict]) -> ChatOptions:
    """How the template renders `messages`: `add_generation_prompt` (default true) opens the
    assistant's reply; `continue_final_message` leaves the last message open instead, so it needs
    `add_generation_prompt: false` (vLLM refuses both: two replies at once) and a last message of
    the assistant's (any other is no reply to continue); `chat_template_kwargs` as
    `template_kwargs` checks them, with `reasoning_effort` as `reasoning_kwargs` adds it;
    `documents` as `template_documents` checks them."""
    generation = flag(body, "add_generation_prompt", default=True)
    final = flag(body, "continue_final_message")
    if final and generation:
        raise InvalidRequest(
            "'continue_final_message' needs 'add_generation_prompt': false (its default is true): "
            "the template cannot both continue the last message and open a new one",
            "continue_final_message",
        )
    if final and (not messages or messages[-1]["role"] != "assistant"):
        raise InvalidRequest(
            "'continue_final_message' continues the last message, which must be the assistant's",
            "continue_final_message",
        )
    kwargs = reasoning_kwargs(body.get("reasoning_effort"), template_kwargs(body.get("chat_template_kwargs")))
    return ChatOptions(generation, final, kwargs, template_documents(body.get("documents")))
