"""A Responses API answer's id, found in its first bytes as they are relayed to the client, and
a stream's opening, until which its silence is bounded by the first-byte timeout.

The gateway must know which worker stored a response (gateway/response_ids.py) before the
client can name it, and must not hold the answer back to learn it: the bytes go on unchanged as
they arrive (`TappedPassThrough`), and `IdTap` reads only the head of the answer. vLLM writes
the id first: a whole answer is a `ResponsesResponse`, `{"id": ...`, and a stream opens with its
`response.created` event, `event: response.created` then `data: {"response": {"id": ...`
(pydantic's field order, OpenAI's too). The tap gives up after HEAD_BYTES without one, so a
head that never ends costs nothing. Where the id is shared with other replicas, recording it
returns the write's acknowledgement, and the chunk that ends the id (its closing quote: before
it the client cannot tell the id whole) and what follows are held from the client until then
(`TappedBody`; gateway/shared_response_ids.py says why and for how long).

A stream opens with `response.created` and `response.in_progress` at once, then says nothing
until its first token: its queue and prefill are a chat stream's wait for its first token, which
the first-byte timeout bounds (gateway/proxy.py), not the idle timeout between tokens. `Opening`
tells when the first event past those (OPENING) arrives, for the relay to bound its silence by
the idle timeout from then on.
"""

import re
from collections.abc import Awaitable, Callable, Sequence

from gateway.relay import BodyPassThrough
from gateway.raw_send import RawBody
from gateway.upstream import Upstream

HEAD_BYTES = 1024
OPENING = frozenset({b"response.created", b"response.queued", b"response.in_progress"})
MAX_LINE = 128  # of a line's start kept across chunks: an `event:` line is shorter
_EVENT = re.compile(rb"^event:[ \t]*(\S*)[ \t]*\r?$", re.M)
_WHOLE = re.compile(rb'\s*\{\s*"id"\s*:\s*"([^"\\]*)"')
_CREATED = re.compile(rb'\s*event:\s*response\.created\r?\ndata:\s*\{\s*"response"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]*)"')

# reads a relayed chunk before the client gets it; what it returns (when not None), the client
# gets that chunk and the rest only once it is done
Tap = Callable[[bytes], Awaitable[None] | None]


def answer_id(head: bytes, streamed: bool) -> str | None:
    """The response id at the start of an answer's `head` (a stream's first event), or None."""
    m = (_CREATED if streamed else _WHOLE).match(head)
    return m.group(1).decode("utf-8", "replace") if m else None


class IdTap:
    """Reads a relayed answer's chunks until its head names the response's id, then tells
    `found` (before the chunk that holds it reaches the client), and returns what `found`
    returns: what that chunk waits for (a `Tap`); `streamed`: an event stream."""

    def __init__(self, streamed: bool, found: Callable[[str], Awaitable[None] | None]):
        self.streamed, self.found = streamed, found
        self.head = b""
        self.done = False
        self.id: str | None = None

    def __call__(self, chunk: bytes) -> Awaitable[None] | None:
        if self.done:
            return None
        self.head += chunk[: HEAD_BYTES - len(self.head)]
        self.id = answer_id(self.head, self.streamed)
        self.done = self.id is not None or len(self.head) >= HEAD_BYTES
        return None if self.id is None else self.found(self.id)


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
    """A client's raw body whose writes `taps` read first. A tap's hold keeps that chunk and
    every later one from the client until it is done: they are taken, and the write says the
    client is full, so the relay reads no more of the worker's answer (`Upstream.pipe`) and
    waits on `drain`, which waits for the hold, then writes what it kept, in order."""

    __slots__ = ("taps", "hold", "held")

    def __init__(self, body: RawBody, taps: Sequence[Tap]):
        super().__init__(body.cycle)
        self.taps = taps
        self.hold: Awaitable[None] | None = None
        self.held: list[bytes] = []

    def write(self, body: bytes) -> bool:
        for tap in self.taps:
            hold = tap(body)
            if hold is not None:
                self.hold = hold
        if self.hold is None:
            return super().write(body)
        self.held.append(body)
        return False

    async def drain(self) -> None:
        if self.hold is not None:
            await self.hold
            self.hold = None
            super().write(b"".join(self.held))
            self.held.clear()
        await super().drain()


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
        taps: Sequence[Tap],
    ):
        super().__init__(upstream, status, idle_timeout, on_error, on_close, headers)
        self.taps = taps

    async def relay_upstream(self, body: RawBody) -> bytes | None:
        return await super().relay_upstream(TappedBody(body, self.taps))
