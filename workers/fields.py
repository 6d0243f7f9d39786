"""Typed reads of a request body's fields: each value a client sends is checked for its JSON type
(a bool is no number, a number no bool) and range before anything uses it; absent and null read
as the field's default. `json_equal` compares a sent value with a known one by the same types."""

import math

from workers.sampling_params import InvalidRequest


def number(body: dict, name: str, default, kind: type = float, param: str | None = None):
    """A finite number (an integer when `kind` is int), or `default` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    what = "an integer" if kind is int else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRequest(f"'{name}' must be {what}", param or name)
    if isinstance(v, float) and not math.isfinite(v):
        raise InvalidRequest(f"'{name}' must be finite", param or name)
    if kind is int:
        if v != int(v):
            raise InvalidRequest(f"'{name}' must be {what}", param or name)
        return int(v)
    try:
        return float(v)
    except OverflowError:
        raise InvalidRequest(f"'{name}' is out of range", param or name) from None


def flag(body: dict, name: str, param: str | None = None, default: bool = False) -> bool:
    """A boolean field, `default` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequest(f"'{name}' must be a boolean", param or name)
    return v


def as_list(v, name: str, item_type: type) -> tuple:
    """A value or a list of values of exactly `item_type` (a bool is no int), as a tuple."""
    if v is None:
        return ()
    if type(v) is item_type:
        return (v,)
    if isinstance(v, list) and all(type(x) is item_type for x in v):
        return tuple(v)
    raise InvalidRequest(f"'{name}' must be a {item_type.__name__} or a list of them", name)


def list_of(v, name: str, item_type: type, what: str) -> tuple | None:
    """A list of values of exactly `item_type` (a bool is no int), as a tuple; None when null.
    `what` names the items in the error."""
    if v is None:
        return None
    if isinstance(v, list) and all(type(x) is item_type for x in v):
        return tuple(v)
    raise InvalidRequest(f"'{name}' must be a list of {what}", name)


def json_equal(a: object, b: object) -> bool:
    """Equality of two JSON values that keeps JSON's types apart: a bool equals only the same
    bool, a number (int or float alike: 0 and 0.0) only an equal number, a list or an object only
    one of equal items. Python's == holds False == 0 and True == 1, so `priority: false` or
    `echo: 0` would pass as the no-op 0 or false they are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) or isinstance(b, (int, float)):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(json_equal, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(v, b[k]) for k, v in a.items())
    return type(a) is type(b) and a == b
