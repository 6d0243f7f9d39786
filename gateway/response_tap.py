"""A Responses API answer's id, found in its first bytes as they are relayed to the client, and
a stream's opening, until which its silence is bounded by the first-byte timeout.

The gateway must know which worker stored a response (gateway/response_ids.py) before the
client can name it, and must not hold the answer back to learn it: the bytes go on unchanged as
they arrive (`TappedPassThrough`), and `IdTap` reads only the head of the answer. vLLM writes
the id first: a whole answer is a `ResponsesResponse`, `{"id": ...`, and a stream opens with its
`response.created` event, `event: response.created` then `data: {"response": {"id": ...`
(pydantic's field order, OpenAI's too). The tap gives up after HEAD_BYTES without one, so a
head that never ends costs nothing.

A stream opens with `response.created` and `response.in_progress` at once, then says nothing
until its first token: its queue and prefill are a chat stream's wait for its first token, which
the first-byte timeout bounds (gateway/proxy.py), not the idle timeout between tokens. `Opening`
tells when the first event past those (OPENING) arrives, for the relay to bound its silence by
the idle timeout from then on.
"""

import re
from collections.abc import Callable

from gateway.relay import BodyPassThrough
from gateway.raw_send import RawBody
from gateway.upstream import Upstream

HEAD_BYTES = 1024
OPENING = frozenset({b"response.created", b"response.queued", b"response.in_progress"})
MAX_LINE = 128  # of a line's start kept across chunks: an `event:` line is shorter
_EVENT = re.compile(rb"^event:[ \t]*(\S*)[ \t]*\r?$", re.M)
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


class Opening:
    """Reads a relayed stream's chunks until an event other than the opening ones (OPENING)
    begins, then tells `opened` (before that chunk reaches the client). Only the start of a line
    cut by a chunk's end is kept."""

    def __init__(self, opened: Callable[[], None]):
        self.opened = opened
        self.line = b""  # the start of the line the last chunk ended in
        self.done = False

    def __call__(self, chunk: bytes) -> None:
        if self.done:
            return
        data = self.line + chunk
        cut = data.rfind(b"\n") + 1
        if any(m.group(1) not in OPENING for m in _EVENT.finditer(data, 0, cut)):
            self.done = True
            self.opened()
        self.line = data[cut : cut + MAX_LINE]


class TappedBody(RawBody):
    """A client's raw body whose writes `taps` read first."""

    __slots__ = ("taps",)

    def __init__(self, body: RawBody, taps: list[Callable[[bytes], None]]):
        super().__init__(body.cycle)
        self.taps = taps

    def write(self, body: bytes) -> bool:
        for tap in self.taps:
            tap(body)
        return super().write(body)


class TappedPassThrough(BodyPassThrough):
    """A worker's answer relayed as `BodyPassThrough` relays it, each chunk read by `taps` on its
    way to the client."""

    def __init__(
        self,
        upstream: Upstream,
        status: int,
        idle_timeout: float,
        on_error: Callable[[Exception], str],
        on_close: Callable[[], None],
        headers: dict[str, str],
        taps: list[Callable[[bytes], None]],
    ):
        super().__init__(upstream, status, idle_timeout, on_error, on_close, headers)
        self.taps = taps

    async def relay_upstream(self, body: RawBody) -> bytes | None:
        return await super().relay_upstream(TappedBody(body, self.taps))
