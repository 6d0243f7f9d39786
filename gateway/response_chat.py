"""A Responses API create as the chat completion the gateway's chat path serves, and that
chat's whole answer read back, for a model of kvgate's workers.

The chat's messages are the create's `instructions` as a system message, then the conversation:
the previous response's (its input items down the chain and its output message, stored with
it), then the new input. Instructions are the create's own and never carried over (OpenAI's
rule), so the rest of a conversation renders to the same text turn after turn, and a
follow-up's prompt starts with its previous one's, which is where the fleet has it cached.
"""

import json
from dataclasses import dataclass

from gateway.intake import ApiError
from gateway.response_object import Usage
from gateway.response_request import CreateRequest, Message

# a chat field's name as the create calls it, where the two differ
RESPONSES_PARAM = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens"}


def chat_messages(req: CreateRequest, conversation: tuple[Message, ...]) -> list[dict]:
    """The chat's messages: the create's instructions as a system message, then `conversation`
    (the history and the new input)."""
    head = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    return head + [m.to_json() for m in conversation]


def chat_body(req: CreateRequest, conversation: tuple[Message, ...]) -> dict:
    """The chat completion body that serves `req` with `conversation`: its sampling fields as
    the chat names them; a stream asks for its usage (the final event the response's usage
    comes from)."""
    body: dict = {"model": req.model, "messages": chat_messages(req, conversation), "stream": req.stream}
    chosen = {
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "user": req.user,
        "cache_salt": req.cache_salt,
    }
    body.update((k, v) for k, v in chosen.items() if v is not None)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def answered(response: dict) -> tuple[Message, ...]:
    """The assistant's message a response output (none where it output no text), which its
    follow-up's history ends with."""
    texts = [
        part["text"]
        for item in response["output"]
        if item.get("type") == "message"
        for part in item["content"]
        if part.get("type") == "output_text"
    ]
    return (Message("assistant", "".join(texts)),) if any(texts) else ()


def as_responses_error(e: ApiError) -> ApiError:
    """The chat path's refusal of the translated body, its param named as the create names it
    (`messages` and the prompt they make are the create's `input` and history, `max_tokens` its
    `max_output_tokens`)."""
    if e.param in RESPONSES_PARAM:
        e.param = RESPONSES_PARAM[e.param]
    return e


@dataclass(frozen=True)
class ChatAnswer:
    """What a whole chat completion answered: its text, finish reason and usage."""

    text: str
    finish_reason: str | None
    usage: Usage | None

    @staticmethod
    def from_whole(raw: bytes) -> "ChatAnswer":
        """A worker's whole 200 chat answer; ValueError when it is not one (a worker is the
        fleet's, but what it wrote is checked where it arrives)."""
        d = json.loads(raw)
        choices = d.get("choices") if isinstance(d, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ValueError("a chat answer without a choice")
        message, reason = choices[0].get("message"), choices[0].get("finish_reason")
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, (str, type(None))) or not isinstance(reason, (str, type(None))):
            raise ValueError("a chat answer's content or finish reason is not a string")
        return ChatAnswer(content or "", reason, Usage.from_chat(d.get("usage")))
