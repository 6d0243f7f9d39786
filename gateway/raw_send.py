"""The gateway's client connections offer each request a `RawBody` (the `RAW_SEND` scope
extension), so a relayed stream's events are written to the client's transport as they arrive,
past the middlewares' send wrappers and uvicorn's `send` (gateway/relay.py `PassThrough`).
Gateway-only: a worker's streams go through `send`."""

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from workers.http_server import ClientConnection

RAW_SEND = "kvgate.send"  # the scope extension whose "body" is the request's `RawBody`


class RawBody:
    """A started response's body written straight to the client's transport, with the chunked
    framing uvicorn's `send` gives a response that has no content-length (as a stream has):
    for a stream's events, which need none of `send`'s checks and no await. Its start and end
    still go through `send`. Nothing is written to a client that is gone."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: RequestResponseCycle):
        self.cycle = cycle

    def write(self, body: bytes) -> bool:
        """Write `body` now; False when the client's buffer is full (wait on `drain`)."""
        cycle = self.cycle
        if body and not cycle.disconnected:
            assert cycle.chunked_encoding and cycle.response_started and not cycle.response_complete
            cycle.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        return not cycle.flow.write_paused

    async def drain(self) -> None:
        """Until the client's buffer has room again (or the client is gone)."""
        await self.cycle.flow.drain()

    def abort(self) -> None:
        """Cut the client's connection before the body's end: its last chunk is never sent, so
        the client sees a broken answer, not a short whole one. uvicorn takes the response as
        ended by a disconnect (nothing more is written, nothing logged)."""
        cycle = self.cycle
        cycle.disconnected = True
        cycle.transport.close()


class RawSendConnection(ClientConnection):
    """A hardened client connection whose requests carry their `RawBody` in the scope."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self.cycle.scope.setdefault("extensions", {})[RAW_SEND] = {"body": RawBody(self.cycle)}
