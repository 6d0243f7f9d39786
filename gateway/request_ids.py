"""A request's two ids at the gateway. Its own (`x-kvgate-request-id`, and the `x-request-id`
the worker sees) is made here for every request, with its kind's prefix, so no client can name,
or collide with, another request's engine state. The client's `x-request-id` is only echoed
back, logged and traced, and only where it keeps the workers' rule for a client's id."""

from starlette.requests import Request

from gateway.forward import PATHS as FORWARDED
from gateway.forward import new_id as forwarded_id
from gateway.responses import RESPONSES_KINDS
from gateway.responses import new_id as responses_id
from workers.protocol import CLIENT_ID
from workers.responses import new_id


def gateway_request_id(kind: str) -> str:
    """A fresh id for a request of `kind`, prefixed as its endpoint's ids are (a forwarded
    kind's, the Responses API's, else a completion's or chat's): a log line's id tells its kind."""
    if kind in FORWARDED:
        return forwarded_id(kind)
    if kind in RESPONSES_KINDS:
        return responses_id()
    return new_id(kind)


def client_request_id(request: Request) -> str | None:
    """The client's `x-request-id` where it keeps the rule the workers hold it and a body's
    `request_id` to (workers.protocol.CLIENT_ID); else None, as if not sent: it is echoed in a
    header, logged and traced, so one of kilobytes or of spaces is not taken."""
    given = request.headers.get("x-request-id")
    return given if given is not None and CLIENT_ID.fullmatch(given) else None
