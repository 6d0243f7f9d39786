"""What the gateway reads of a Responses API create body (`POST /v1/responses`, vLLM 0.32's
`ResponsesRequest`): the fields that steer its routing and recording, and the texts a key's
tokens-per-minute budget is charged for; and of a retrieve's query. Every field the gateway
reads is checked here; the rest is vLLM's to validate (gateway/responses.py forwards the body
otherwise unchanged).
"""

from dataclasses import dataclass

from starlette.requests import Request

from gateway.intake import ApiError
from gateway.response_request import InvalidField, previous_id
from workers.protocol import checked_cache_salt
from workers.sampling_params import InvalidRequest

MAX_STARTING_AFTER = 2**31 - 1
# vLLM takes a body's `request_id` as the id of the response it stores, so a client that set it
# could name (and overwrite) another tenant's stored response on the same server.
CLIENT_REFUSED = "request_id"


@dataclass(frozen=True)
class CreateFields:
    """A create's routing fields: the response it follows, whether it streams, whether the
    server stores it (vLLM's default: yes), whether it runs in the background, and the output
    tokens it asks for at most."""

    previous_response_id: str | None
    stream: bool
    store: bool
    background: bool
    max_output_tokens: int | None


def create_fields(body: dict) -> CreateFields:
    """The routing fields of a create body, checked: `previous_response_id` as
    gateway/response_request.py's `previous_id` reads it (one rule for both paths), `stream`,
    `store` and `background` booleans, `max_output_tokens` a positive integer, `instructions` a
    string, `cache_salt` a salt as for completions (the tenant's replaces it); `request_id`
    refused (CLIENT_REFUSED). Null is a field's default. Raises InvalidField (or a 404 for an
    id no response of this gateway's can have)."""
    if body.get(CLIENT_REFUSED) is not None:
        raise ApiError(
            400,
            "'request_id' names the response a server stores: the server picks it, a client may not",
            param=CLIENT_REFUSED,
            code="internal_field",
        )
    previous = previous_id(body.get("previous_response_id"))
    for name in ("stream", "store", "background"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidField(f"'{name}' must be a boolean", name)
    most = body.get("max_output_tokens")
    if most is not None and (type(most) is not int or most < 1):
        raise InvalidField("'max_output_tokens' must be a positive integer", "max_output_tokens")
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise InvalidField("'instructions' must be a string", "instructions")
    try:
        checked_cache_salt(body)
    except InvalidRequest as e:
        raise InvalidField(str(e), "cache_salt") from None
    return CreateFields(
        previous, body.get("stream") is True, body.get("store") is not False, body.get("background") is True, most
    )


def input_texts(body: dict) -> tuple[list[str], bool]:
    """The texts a create's input is charged for, and whether it also holds inputs charged by
    a byte estimate: `instructions`, and `input` (required) as a string or a list of items
    (objects), an item's `content` a string or a list of parts (objects), a part's `text`
    counted. Items without content (function calls and their outputs, reasoning) and parts
    without text (images, files) are estimated. Raises InvalidField."""
    texts = [body["instructions"]] if isinstance(body.get("instructions"), str) else []
    given = body.get("input")
    if isinstance(given, str):
        return [*texts, given], False
    if not isinstance(given, list):
        raise InvalidField("'input' is required: a string or a list of input items", "input")
    estimated = False
    for item in given:
        if not isinstance(item, dict):
            raise InvalidField("'input' items are objects", "input")
        content = item.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            if not all(isinstance(part, dict) for part in content):
                raise InvalidField("an input item's 'content' parts are objects", "input")
            parts = [part.get("text") for part in content]
            texts += [t for t in parts if isinstance(t, str)]
            estimated |= any(not isinstance(t, str) for t in parts)
        elif content is None:
            estimated = True
        else:
            raise InvalidField("an input item's 'content' is a string or a list of parts", "input")
    return texts, estimated


def retrieve_query(request: Request) -> str:
    """A retrieve's query as vLLM reads it, checked: `stream` true or false, `starting_after`
    (the event to replay after) a non-negative integer; other parameters are not forwarded."""
    q = request.query_params
    out = []
    stream = q.get("stream")
    if stream is not None:
        if stream not in ("true", "false"):
            raise ApiError(400, "'stream' must be true or false", param="stream")
        out.append(f"stream={stream}")
    after = q.get("starting_after")
    if after is not None:
        if not (after.isascii() and after.isdigit() and int(after) <= MAX_STARTING_AFTER):
            raise ApiError(400, "'starting_after' must be a non-negative integer", param="starting_after")
        out.append(f"starting_after={int(after)}")
    return "?" + "&".join(out) if out else ""
