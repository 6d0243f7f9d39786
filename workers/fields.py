"""Typed reads of a request body's fields: each value a client sends is checked for its JSON type
(a bool is no number, a number no bool) and range before anything uses it; absent and null read
as the field's default."""

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
