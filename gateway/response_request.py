"""A Responses API create (`POST /v1/responses`) for a model of kvgate's own workers, read as a
hostile client's: every field's type, range and size checked, and a field the gateway does not
implement refused with a 400 naming it, as the chat path refuses what it does not implement
(workers/unsupported.py), never silently ignored.

Served: `model`, `input` (a string, or message items of role user, assistant, system or
developer whose content is a string or `input_text`/`output_text` parts), `instructions`,
`previous_response_id`, `max_output_tokens`, `temperature`, `top_p`, `seed` (vLLM's), `stream`,
`store`, `metadata`, `user`, `cache_salt` (vLLM's); and at the value that asks for nothing only:
`text` (plain text), `truncation` ("disabled"), `tools` (none), `tool_choice` (none, auto),
`parallel_tool_calls`, `reasoning` (none), `background` (false), `include` (none),
`top_logprobs` (0), `service_tier` (auto, default).
"""

import math
from dataclasses import dataclass, field

from gateway.intake import ApiError
from gateway.response_ids import MAX_ID_CHARS, valid_id
from workers.fields import json_equal
from workers.protocol import MAX_SESSION_ID
from workers.sampling_params import MAX_INT32

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
MAX_ITEMS = 4096  # input items in one create
MAX_PARTS = 256  # content parts in one item
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
MAX_SEED = 2**63
SERVED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "previous_response_id",
        "max_output_tokens",
        "temperature",
        "top_p",
        "seed",
        "stream",
        "store",
        "metadata",
        "user",
        "cache_salt",
        "parallel_tool_calls",
    }
)
# Fields not implemented for kvgate's workers, with the values that ask for nothing (null always does).
NOOP_VALUES: dict[str, tuple] = {
    "text": ({}, {"format": {"type": "text"}}),
    "truncation": ("disabled",),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "reasoning": ({}, {"effort": None}, {"effort": None, "summary": None}),
    "background": (False,),
    "include": ([],),
    "top_logprobs": (0,),
    "service_tier": ("auto", "default"),
}
WHY = {
    "background": "a background response is not served for kvgate's workers: the gateway answers while "
    "the model generates (create without it, streamed if the answer is long)",
    "truncation": "'auto' truncation is not served: a conversation past the model's context is a 400",
    "text": "only plain text output ({'format': {'type': 'text'}}) is served",
    "tools": "tools are not served for kvgate's workers",
    "tool_choice": "tools are not served for kvgate's workers: tool_choice may be none or auto",
    "reasoning": "reasoning options are not served for kvgate's workers",
}
# Item fields: a message item, as a client writes one or as a response's output item is sent back.
ITEM_FIELDS = frozenset({"type", "role", "content", "id", "status"})
PART_FIELDS = frozenset({"type", "text", "annotations", "logprobs"})


class InvalidField(ApiError):
    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(400, message, param=param, code=code)


@dataclass(frozen=True)
class Message:
    """One message of a conversation as the chat path takes it: a role and its text (parts
    joined with newlines, as the chat template joins them)."""

    role: str
    content: str

    def to_json(self) -> dict:
        return {"role": self.role, "content": self.content}

    @staticmethod
    def from_json(d: object) -> "Message":
        """ValueError unless `d` is a message this gateway wrote."""
        if not isinstance(d, dict) or set(d) != {"role", "content"}:
            raise ValueError("a message is an object of role and content")
        role, content = d["role"], d["content"]
        if role not in ROLES or not isinstance(content, str):
            raise ValueError("a message's role or content is not one the gateway writes")
        return Message(role, content)


@dataclass(frozen=True)
class CreateRequest:
    """A checked create: its input as messages, and each parameter the answer echoes (None: not
    given)."""

    model: str
    input: tuple[Message, ...]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    cache_salt: str | None = None
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True


def parse_create(body: dict, model: str) -> CreateRequest:
    """`body` (a JSON object, its `model` resolved to `model`) as a create for kvgate's workers;
    raises InvalidField naming the first bad or unserved field."""
    refuse_unserved(body)
    return CreateRequest(
        model=model,
        input=input_messages(body.get("input")),
        instructions=text(body, "instructions"),
        previous_response_id=previous_id(body.get("previous_response_id")),
        max_output_tokens=integer(body, "max_output_tokens", 1, MAX_INT32),
        temperature=real(body, "temperature", 0.0, 2.0, closed=True),
        top_p=real(body, "top_p", 0.0, 1.0, closed=False),
        seed=integer(body, "seed", -MAX_SEED, MAX_SEED - 1),
        stream=boolean(body, "stream", False),
        store=boolean(body, "store", True),
        metadata=metadata(body.get("metadata")),
        user=text(body, "user", MAX_SESSION_ID),
        cache_salt=text(body, "cache_salt"),
        tool_choice=body.get("tool_choice") or "auto",
        parallel_tool_calls=boolean(body, "parallel_tool_calls", True),
    )


def refuse_unserved(body: dict) -> None:
    """A 400 for the first field neither served nor at its no-op value (an unknown field: one
    400 naming every unknown one)."""
    unknown = sorted(k for k in body if k not in SERVED and k not in NOOP_VALUES)
    if unknown:
        names = ", ".join(f"'{k[:64]}'" for k in unknown[:8])
        raise InvalidField(
            f"unknown or unsupported field(s) {names}: not served by the Responses API for kvgate's workers",
            unknown[0][:64],
            "unsupported_parameter",
        )
    for name, noop in NOOP_VALUES.items():
        v = body.get(name)
        if v is not None and not any(json_equal(v, n) for n in noop):
            why = WHY.get(name, "not served by the Responses API for kvgate's workers")
            raise InvalidField(f"'{name}': {why}", name, "unsupported_parameter")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise InvalidField("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")


def input_messages(given: object) -> tuple[Message, ...]:
    """`input` as messages: a string is one user message; a list holds message items."""
    if isinstance(given, str):
        return (Message("user", given),)
    if not isinstance(given, list) or not given:
        raise InvalidField("'input' is required: a string or a non-empty list of message items", "input")
    if len(given) > MAX_ITEMS:
        raise InvalidField(f"'input' holds more than {MAX_ITEMS} items", "input")
    return tuple(item_message(item, f"input[{i}]", i == len(given) - 1) for i, item in enumerate(given))


def item_message(item: object, where: str, last: bool) -> Message:
    """One input item, which must be a message (other item kinds are refused, naming them)."""
    if not isinstance(item, dict):
        raise InvalidField(f"'{where}' must be an object", where)
    kind = item.get("type", "message")
    if kind != "message":
        shown = repr(kind[:64]) if isinstance(kind, str) else "a non-string type"
        raise InvalidField(
            f"'{where}': an item of type {shown} is not served for kvgate's workers (message items only)",
            f"{where}.type",
            "unsupported_parameter",
        )
    extra = sorted(k for k in item if k not in ITEM_FIELDS)
    if extra:
        raise InvalidField(f"'{where}': unknown field '{extra[0][:64]}'", f"{where}.{extra[0][:64]}")
    role = item.get("role")
    if role not in ROLES:
        raise InvalidField(f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
    status = item.get("status")
    if status is not None and status != "completed":
        if status not in ("in_progress", "incomplete"):
            raise InvalidField(f"'{where}.status' must be completed, in_progress or incomplete", f"{where}.status")
        if last:
            raise InvalidField(
                f"'{where}': continuing a partial message (status {status}) is not served for kvgate's workers",
                f"{where}.status",
                "unsupported_parameter",
            )
    if item.get("id") is not None and not isinstance(item["id"], str):
        raise InvalidField(f"'{where}.id' must be a string", f"{where}.id")
    return Message(role, content_text(item.get("content"), where))


def content_text(content: object, where: str) -> str:
    """An item's content as one string: text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidField(f"'{where}.content' must be a string or a list of content parts", f"{where}.content")
    if len(content) > MAX_PARTS:
        raise InvalidField(f"'{where}.content' holds more than {MAX_PARTS} parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise InvalidField(f"'{at}' must be an object", at)
        kind = part.get("type")
        if kind not in TEXT_PARTS:
            shown = repr(kind[:64]) if isinstance(kind, str) else "no string type"
            raise InvalidField(
                f"'{at}': a content part of {shown} is not served for kvgate's workers "
                f"(text parts only: {', '.join(TEXT_PARTS)})",
                f"{at}.type",
                "unsupported_parameter",
            )
        extra = sorted(k for k in part if k not in PART_FIELDS)
        if extra:
            raise InvalidField(f"'{at}': unknown field '{extra[0][:64]}'", f"{at}.{extra[0][:64]}")
        if not isinstance(part.get("text"), str):
            raise InvalidField(f"'{at}.text' must be a string", f"{at}.text")
        if part.get("annotations") not in (None, []) or part.get("logprobs") not in (None, []):
            raise InvalidField(f"'{at}': annotations and logprobs are not served as input", at)
        texts.append(part["text"])
    return "\n".join(texts)


def previous_id(given: object) -> str | None:
    if given is None:
        return None
    if not isinstance(given, str) or not 0 < len(given) <= MAX_ID_CHARS:
        raise InvalidField(
            f"'previous_response_id' must be a response id: 1 to {MAX_ID_CHARS} characters", "previous_response_id"
        )
    if not valid_id(given):  # no response of this gateway's has it: the same 404 as an unknown one
        raise ApiError(
            404, f"Response with id '{given}' not found.", code="response_not_found", param="previous_response_id"
        )
    return given


def metadata(given: object) -> dict[str, str]:
    """OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, string values of at most 512."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise InvalidField("'metadata' must be an object of strings", "metadata")
    if len(given) > MAX_METADATA_PAIRS:
        raise InvalidField(f"'metadata' holds at most {MAX_METADATA_PAIRS} pairs", "metadata")
    for k, v in given.items():
        if len(k) > MAX_METADATA_KEY:
            raise InvalidField(f"a 'metadata' key is at most {MAX_METADATA_KEY} characters", "metadata")
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
            raise InvalidField(f"a 'metadata' value is a string of at most {MAX_METADATA_VALUE} characters", "metadata")
    return dict(given)


def text(body: dict, name: str, most: int | None = None) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise InvalidField(f"'{name}' must be a string", name)
    if most is not None and len(v) > most:
        raise InvalidField(f"'{name}' is at most {most} characters", name)
    return v


def boolean(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidField(f"'{name}' must be a boolean", name)
    return v


def integer(body: dict, name: str, low: int, high: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if type(v) is not int or not low <= v <= high:
        raise InvalidField(f"'{name}' must be an integer in [{low}, {high}]", name)
    return v


def real(body: dict, name: str, low: float, high: float, closed: bool) -> float | None:
    """A number in [low, high] (`closed`) or (low, high]."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidField(f"'{name}' must be a number", name)
    if not (low <= v <= high if closed else low < v <= high):
        shown = f"[{low:g}, {high:g}]" if closed else f"({low:g}, {high:g}]"
        raise InvalidField(f"'{name}' must be in {shown}", name)
    return float(v)
