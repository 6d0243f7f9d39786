"""A worker's /kv/events stream as the gateway reads it: whole JSON lines out of whatever reads
the connection gives (`Lines`, a sink for `gateway.upstream.Upstream.pipe`)."""

import json
from collections.abc import Callable

from gateway.upstream import Upstream

LINE_BYTES = 1 << 22  # the longest line read: a line is a whole batch of events


class Lines:
    """The sink of a /kv/events stream (`Upstream.pipe`): its body cut into JSON lines, each
    line's state merged onto the stream's last (lines carry what changed) and handed to `apply`
    from `data_received` itself, so a line costs no task wakeup (aiohttp's reader was one a
    line, twice a request). `apply` returning False, a line that is not a batch, or one past
    `LINE_BYTES` ends the stream (`ended`; `error`, always a ValueError, for the latter two)
    and closes `conn`."""

    def __init__(self, apply: Callable[[dict], bool], conn: Upstream):
        self.apply, self.conn = apply, conn
        self.partial = b""
        self.state: dict = {}
        self.ended = False
        self.error: ValueError | None = None

    def __call__(self, chunk: bytes) -> bool:
        if self.ended:
            return True
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        try:
            if len(self.partial) > LINE_BYTES:
                raise ValueError(f"a /kv/events line over {LINE_BYTES} bytes")
            for line in lines:
                if not self.apply(self._body(line)):
                    return self._end()
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            self.error = e if isinstance(e, ValueError) else ValueError(f"not a KV-event batch: {e!r}")
            return self._end()
        return True

    def _body(self, line: bytes) -> dict:
        body = json.loads(line)
        if isinstance(body.get("state"), dict):
            self.state = body["state"] = self.state | body["state"]
        return body

    def _end(self) -> bool:
        self.ended = True
        self.conn.close()
        return True


async def never_full() -> None:
    """A `Lines` sink is never full."""
