"""A Responses API answer's id, found in its first bytes as they are relayed to the client.

The gateway must know which worker stored a response (gateway/response_ids.py) before the
client can name it, and must not hold the answer back to learn it: the bytes go on unchanged as
they arrive (`TappedPassThrough`), and `IdTap` reads only the head of the answer. vLLM writes
the id first: a whole answer is a `ResponsesResponse`, `{"id": ...`, and a stream opens with its
`response.created` event, `event: response.created` then `data: {"response": {"id": ...`
(pydantic's field order, OpenAI's too). The tap gives up after HEAD_BYTES without one, so a
head that never ends costs nothing.
"""

import re
from collections.abc import Callable

from gateway.relay import BodyPassThrough
from gateway.raw_send import RawBody
from gateway.upstream import Upstream

HEAD_BYTES = 1024
_WHOLE = re.compile(rb'\s*\{\s*"id"\s*:\s*"([^"\\]*)"')
_CREATED = re.compile(rb'\s*event:\s*response\.created\r?\ndata:\s*\{\s*"response"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]*)"')


def answer_id(head: bytes, streamed: bool) -> str | None:
    """The response id at the start of an answer's `head` (a stream's first event), or None."""
    m = (_CREATED if streamed else _WHOLE).match(head)
    return m.group(1).decode("utf-8", "replace") if m else None


class IdTap:
    """Reads a relayed answer's chunks until its head names the response's id, then tells
    `found` (before the chunk that holds it reaches the client); `streamed`: an event stream."""

    def __init__(self, streamed: bool, found: Callable[[str], None]):
        self.streamed, self.found = streamed, found
        self.head = b""
        self.done = False
        self.id: str | None = None

    def __call__(self, chunk: bytes) -> None:
        if self.done:
            return
        self.head += chunk[: HEAD_BYTES - len(self.head)]
        self.id = answer_id(self.head, self.streamed)
        if self.id is not None:
            self.found(self.id)
        self.done = self.id is not None or len(self.head) >= HEAD_BYTES


class TappedBody(RawBody):
    """A client's raw body whose writes `tap` reads first."""

    __slots__ = ("tap",)

    def __init__(self, body: RawBody, tap: Callable[[bytes], None]):
        super().__init__(body.cycle)
        self.tap = tap

    def write(self, body: bytes) -> bool:
        self.tap(body)
        return super().write(body)


class TappedPassThrough(BodyPassThrough):
    """A worker's answer relayed as `BodyPassThrough` relays it, each chunk read by `tap` on its
    way to the client."""

    def __init__(
        self,
        upstream: Upstream,
        status: int,
        idle_timeout: float,
        on_error: Callable[[Exception], str],
        on_close: Callable[[], None],
        headers: dict[str, str],
        tap: Callable[[bytes], None],
    ):
        super().__init__(upstream, status, idle_timeout, on_error, on_close, headers)
        self.tap = tap

    async def relay_upstream(self, body: RawBody) -> bytes | None:
        return await super().relay_upstream(TappedBody(body, self.tap))
