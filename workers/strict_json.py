"""JSON from a hostile client: parsed strictly, or refused as the client's error.

Python's `json` accepts what JSON does not (`NaN`, `Infinity`), nests until the interpreter's
recursion limit, raises a bare ValueError for integers past 4,300 digits and happily returns
strings holding lone surrogates, which no tokenizer or UTF-8 encoder takes. Any of these
reaching later code was a 500; here each is an `InvalidRequest` (a 400) before anything reads
the body. The tree walk that checks depth and strings runs only when the raw bytes hint at
either (many brackets, a surrogate escape), so an ordinary body costs one `json.loads`.
`peer_object` holds what other processes wrote (a Redis record, a peer's answer) to the same rules.
"""

import json
import re

from workers.sampling_params import InvalidRequest

MAX_DEPTH = 32  # OpenAI bodies nest < 10 deep (a JSON-schema response_format perhaps 20)
MAX_PEER_BYTES = 1 << 22  # a heartbeat or NIXL agent record is a few KiB
_SCALARS = {int, float, bool, type(None)}  # what holds neither text nor depth
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # an escape or CESU-8 bytes


def loads(raw: bytes, what: str = "the request body") -> object:
    """`raw` as JSON: standard JSON only, at most MAX_DEPTH containers deep, valid Unicode
    (`what` names it in the error)."""
    try:
        obj = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequest(f"{what} is not valid JSON: {_reason(e)}") from None
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH or _SURROGATE.search(raw):
        check_tree(obj, what)
    return obj


def peer_object(raw: bytes | str, what: str, max_bytes: int = MAX_PEER_BYTES) -> dict:
    """`raw`, which another process wrote where this one reads it, as a JSON object by `loads`'s
    rules and at most `max_bytes` long; else ValueError naming `what`. Anything that can write
    there can write it, and no record may overflow this process's stack or stop its loop."""
    if len(raw) > max_bytes:
        raise ValueError(f"{what} is over {max_bytes} bytes")
    try:
        obj = loads(raw.encode() if isinstance(raw, str) else raw, what)
    except InvalidRequest as e:
        raise ValueError(str(e)) from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not a JSON object")
    return obj


def check_tree(obj: object, what: str = "the request body") -> None:
    """Raise InvalidRequest if containers nest deeper than MAX_DEPTH or a string (or key) is not
    valid Unicode. Iterative, so no depth can overflow the stack."""
    stack = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _valid_text(node, what)
            continue
        if isinstance(node, dict):
            children = [*node.keys(), *node.values()]
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth >= MAX_DEPTH:
            raise InvalidRequest(f"{what} nests deeper than {MAX_DEPTH} levels")
        if not set(map(type, children)) <= _SCALARS:  # a list of token ids is skipped at C speed
            stack.extend((child, depth + 1) for child in children)


def _valid_text(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{what} holds a lone surrogate (\\ud800-\\udfff): not valid Unicode") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _reason(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, UnicodeDecodeError):
        return "not UTF-8"
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at character {e.pos}"
    return str(e).split(":")[0][:200]
