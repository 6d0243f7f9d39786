"""OpenAI chat messages -> the model's chat template -> prompt text, as vLLM renders them for
templates that take string content.

The template never sees a client's message as sent: each is rebuilt from checked fields. Content
becomes one string (text parts joined with newlines, `None` as ""), so an assistant message that
carries only `tool_calls`, or content given as a list of parts, renders like plain text; a role
is one the OpenAI API names; tool calls keep their id and function name, with the JSON
arguments parsed into an object (the form templates index). A template that still refuses the
conversation (say, roles that must alternate) is the client's error, a 400, never the server's.

How the template renders is vLLM's chat fields (`ChatOptions`): the assistant's reply opened
(`add_generation_prompt`) or the last assistant message left open to continue
(`continue_final_message`), the client's own template variables (`chat_template_kwargs`), its
`reasoning_effort` and its retrieved `documents`, each passed as vLLM passes it.
"""

import json
from dataclasses import dataclass, field

from jinja2 import TemplateError

from workers.sampling_params import InvalidRequest
from workers.strict_json import loads

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
# apply_chat_template's own parameters and the names it renders the template with: a client's
# template variable may add to what the template reads, never change how the prompt is built.
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "conversations",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
MAX_KWARGS_CHARS = 16384  # as JSON: template switches and short strings (enable_thinking, reasoning_effort)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM 0.32's
MAX_DOCUMENTS = 256
MAX_DOCUMENTS_CHARS = 1 << 19  # keys and values: about 128k tokens of text, more than most contexts hold


@dataclass(frozen=True)
class ChatOptions:
    """How the template renders a conversation (vLLM's chat fields, its defaults): the
    assistant's reply opened, or the last (assistant) message left open for the model to
    continue; `kwargs`: the client's variables for the template (`chat_template_kwargs`, and
    `reasoning_effort` as `reasoning_kwargs` adds it); `documents`: the template's RAG documents
    (None: the template is not given any)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, object] = field(default_factory=dict)
    documents: list[dict[str, str]] | None = None


def render_chat(conversation: list[dict], tokenizer, options: ChatOptions | None = None) -> str:
    """The prompt text of messages `chat_messages` has checked, under the tokenizer's chat
    template as `options` ask (InvalidRequest if it has none or refuses them)."""
    o = options or ChatOptions()
    try:
        return tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=o.add_generation_prompt,
            continue_final_message=o.continue_final_message,
            documents=o.documents,
            **o.kwargs,
        )
    except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise InvalidRequest(f"the chat template cannot render these messages: {str(e)[:300]}", "messages") from None


def template_kwargs(value: object) -> dict[str, object]:
    """`chat_template_kwargs`, checked: an object (null: none) of at most MAX_KWARGS_CHARS as
    JSON, setting none of RESERVED_KWARGS. Its values go to the template and nowhere else, so a
    client changes what the template reads, never how kvgate builds the prompt."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InvalidRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    if len(json.dumps(value)) > MAX_KWARGS_CHARS:
        raise InvalidRequest(
            f"'chat_template_kwargs' is longer than {MAX_KWARGS_CHARS} characters as JSON", "chat_template_kwargs"
        )
    reserved = sorted(RESERVED_KWARGS.intersection(value))
    if reserved:
        raise InvalidRequest(
            f"'chat_template_kwargs' may not set {', '.join(reserved)}: they are the template call's own "
            "(send add_generation_prompt and continue_final_message as request fields)",
            "chat_template_kwargs",
        )
    return value


def reasoning_kwargs(effort: object, kwargs: dict[str, object]) -> dict[str, object]:
    """`kwargs` with the request's `reasoning_effort` (null: none; else one of REASONING_EFFORTS)
    as vLLM hands it to the template: as `reasoning_effort`, over any that `kwargs` set, and as
    `enable_thinking` (false only for "none") unless `kwargs` set that, so a template that thinks
    only when asked (Qwen3's, Gemma's) thinks when an effort is asked."""
    if effort is None:
        return kwargs
    if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
        raise InvalidRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
    return {"enable_thinking": effort != "none", **kwargs, "reasoning_effort": effort}


def template_documents(value: object) -> list[dict[str, str]] | None:
    """`documents` (vLLM's RAG documents, each an object of strings such as {"title", "text"}),
    checked (null: none): at most MAX_DOCUMENTS of at most MAX_DOCUMENTS_CHARS in all, so a
    megabyte list is refused before the template renders it. Copies, as messages are."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(d, dict) for d in value):
        raise InvalidRequest("'documents' must be a list of objects", "documents")
    if len(value) > MAX_DOCUMENTS:
        raise InvalidRequest(f"'documents' holds at most {MAX_DOCUMENTS} documents", "documents")
    if not all(isinstance(k, str) and isinstance(v, str) for d in value for k, v in d.items()):
        raise InvalidRequest("each document in 'documents' must map names to strings", "documents")
    if sum(len(k) + len(v) for d in value for k, v in d.items()) > MAX_DOCUMENTS_CHARS:
        raise InvalidRequest(f"'documents' holds more than {MAX_DOCUMENTS_CHARS} characters", "documents")
    return [dict(d) for d in value]


def chat_messages(messages: object) -> list[dict]:
    """Checked, template-ready copies of the messages."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of messages", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m: object, where: str) -> dict:
    if not isinstance(m, dict):
        raise InvalidRequest(f"'{where}' must be an object with a role", "messages")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequest(f"'{where}.role' must be one of {', '.join(ROLES)}", "messages")
    out: dict[str, object] = {"role": role, "content": _content(m.get("content"), where)}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            out[key] = _text(m[key], f"{where}.{key}")
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise InvalidRequest(f"'{where}.tool_calls': only assistant messages carry tool calls", "messages")
        out["tool_calls"] = _tool_calls(m["tool_calls"], where)
    return out


def _content(content: object, where: str) -> str:
    """A message's content as one string; a list of text parts is joined with newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}.content' must be a string or a list of content parts", "messages")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            shown = f"type {kind[:40]!r}" if isinstance(kind, str) else "no type"
            raise InvalidRequest(
                f"'{where}.content[{j}]': a content part of {shown} is not supported "
                f"(this model takes text parts: {', '.join(TEXT_PARTS)})",
                "messages",
            )
        if part.get(key) is not None:
            texts.append(_text(part[key], f"{where}.content[{j}].{key}"))
    return "\n".join(texts)


def _tool_calls(calls: object, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise InvalidRequest(f"'{where}.tool_calls' must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise InvalidRequest(f"'{at}' must be an object with a 'function'", "messages")
        arguments = _arguments(_text(fn.get("arguments", "{}"), f"{at}.function.arguments"), at)
        entry = {
            "type": "function",
            "function": {"name": _text(fn.get("name"), f"{at}.function.name"), "arguments": arguments},
        }
        if call.get("id") is not None:
            entry["id"] = _text(call["id"], f"{at}.id")
        out.append(entry)
    return out


def _arguments(raw: str, at: str) -> dict:
    """A tool call's arguments: a string that must hold a JSON object."""
    try:
        arguments = loads(raw.encode())
    except InvalidRequest:
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"'{at}.function.arguments' must be a JSON object encoded as a string", "messages")
    return arguments


def _text(v: object, where: str) -> str:
    if not isinstance(v, str):
        raise InvalidRequest(f"'{where}' must be a string", "messages")
    return v
