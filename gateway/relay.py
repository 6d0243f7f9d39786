"""A worker's answer relayed to the client once it is committed: a stream's events
(`PassThrough`, through `Relay`) or another answer's bytes (`BodyPassThrough`), written to
the client's transport as they arrive, past starlette's and uvicorn's send path.

Silence past `idle_timeout` (time waiting on a slow client does not count) or a broken
connection ends it: a stream with an SSE error event and `[DONE]`, another answer by cutting
the client's connection, since a committed answer can no longer be retried elsewhere. A
failure on the gateway's side of the relay (`SinkFailed`: the client's end raised) is logged
and cuts the client's connection, and is never told to `on_error`: it says nothing of the worker.
"""

import asyncio
import json
import logging
from collections.abc import Callable

from starlette.responses import Response

from gateway.proxy import UpstreamFailed, UpstreamTimeout
from gateway.raw_send import RAW_SEND, RawBody
from gateway.tap import StreamTap
from gateway.upstream import SinkFailed, Upstream

log = logging.getLogger("kvgate.gateway")

DONE = b"data: [DONE]\n\n"


class Relay:
    """The sink of a committed stream (`Upstream.pipe`): whole SSE events, read by `tap` in
    passing, go on to the client as they arrive, starting with `head` (what `first_token` read,
    already fed to `tap`). Only a trailing partial event is held back until its end arrives,
    so that if the worker dies or falls silent the client gets whole events, then a clean
    error event and `[DONE]`; and a final `[DONE]`, to go with the response's end in one write
    (one fewer write and wakeup of the client a stream)."""

    def __init__(self, tap: StreamTap, head: bytes):
        self.tap = tap
        cut = head.rfind(b"\n\n") + 2
        self.head, self.partial, self.done = head[:cut], head[cut:], b""
        self.write: Callable[[bytes], bool] = _nowhere

    def start(self, write: Callable[[bytes], bool]) -> None:
        self.write = write
        write(self.head)

    def __call__(self, chunk: bytes) -> bool:
        """Take what arrived; False when the client cannot take more for now."""
        if self.partial:
            chunk, self.partial = self.partial + chunk, b""
        if not chunk.endswith(b"\n\n"):
            cut = chunk.rfind(b"\n\n") + 2
            chunk, self.partial = chunk[:cut], chunk[cut:]
            if not chunk:
                return True
        chunk = self.tap.feed(chunk)
        if chunk.endswith(DONE):
            chunk, self.done = chunk[: -len(DONE)], DONE
        return self.write(chunk) if chunk else True

    def end(self) -> bytes:
        """The stream ended whole: what was held back, to be sent with the response's end."""
        return self.done + self.partial


def _nowhere(chunk: bytes) -> bool:
    raise RuntimeError("a relay writes only once started")


class PassThrough(Response):
    """A committed upstream stream relayed to the client: its events are written to the
    client's transport from the upstream connection's `data_received` (`RawBody`, past uvicorn's
    `send` and the middlewares' wrappers, which only look at a response's start and end, and
    those still go through them), so an event costs no task wakeup. The upstream response is
    closed, and `on_close` run, however the stream ends: finished, failed (`on_error` is told
    and returns the message of the error event sent), cancelled by a client disconnect, or never
    started because the client was gone before the first byte.

    One plain task watches for the client's disconnect and cancels the stream, instead of
    starlette's task group (anyio, ~0.1 ms a response)."""

    media_type: str | None = "text/event-stream"

    def __init__(
        self,
        upstream: Upstream,
        relay: Relay,
        idle_timeout: float,
        on_error: Callable[[Exception], str],
        on_close: Callable[[], None],
        headers: dict[str, str],
    ):
        self.status_code, self.background = 200, None
        self.init_headers(headers)
        self.upstream, self.relay, self.idle_timeout, self.on_error = upstream, relay, idle_timeout, on_error
        self.on_close: list[Callable[[], None]] = [on_close]

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        assert task is not None, "an ASGI app runs in a task"
        watcher = asyncio.ensure_future(_cancel_on_disconnect(receive, task))
        body: RawBody = scope["extensions"][RAW_SEND]["body"]
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            last = await self.relay_upstream(body)
            if last is not None:  # None: the client's connection was cut (`BodyPassThrough`)
                await send({"type": "http.response.body", "body": last, "more_body": False})
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # not the client's disconnect: the server's own cancellation
            task.uncancel()  # the client left: the stream ends here, as starlette's would
        finally:
            watcher.cancel()
            self.upstream.release()
            for callback in self.on_close:
                callback()

    async def relay_upstream(self, body: RawBody) -> bytes | None:
        """Relay the stream to its end; returns what goes with the response's end: what the
        relay held back, or an error event and `[DONE]` if the worker failed."""
        self.relay.start(body.write)
        try:
            await self.upstream.pipe(self.relay, body.drain, self.idle_timeout)
            return self.relay.end()
        except SinkFailed:
            cut_off(body)
            return None
        except OSError as e:  # TimeoutError too
            silent = isinstance(e, TimeoutError)
            message = self.on_error(
                UpstreamTimeout(f"no event for {self.idle_timeout:g} s")
                if silent
                else UpstreamFailed(f"{type(e).__name__}: {e}")
            )
            return sse_error(message) + DONE


class BodyPassThrough(PassThrough):
    """A worker's answer that is not an event stream (an embedding, a tokenization) relayed to
    the client as its bytes arrive, with the worker's status and `headers` (its content type):
    never held whole in the gateway however large, and cut only after `idle_timeout` without a
    byte (time waiting on a slow client does not count), not after a total time, which failed a
    large healthy answer on a slow link. The answer is committed with its head: a worker that
    fails after it cannot be retried or turned into an error answer, so `on_error` is told and
    the client's connection is cut before the body's last chunk (`RawBody.abort`), and a
    broken-off answer never reads as a whole one. `on_close` runs however it ends, as for a
    stream."""

    media_type = None  # the worker's, in `headers`

    def __init__(
        self,
        upstream: Upstream,
        status: int,
        idle_timeout: float,
        on_error: Callable[[Exception], str],
        on_close: Callable[[], None],
        headers: dict[str, str],
    ):
        self.status_code, self.background = status, None
        self.init_headers(headers)
        self.upstream, self.idle_timeout, self.on_error = upstream, idle_timeout, on_error
        self.on_close = [on_close]

    async def relay_upstream(self, body: RawBody) -> bytes | None:
        try:
            await self.upstream.pipe(body.write, body.drain, self.idle_timeout)
            return b""
        except SinkFailed:
            cut_off(body)
            return None
        except OSError as e:  # TimeoutError too (its bound may have changed: `Upstream.bound_idle`)
            self.on_error(
                UpstreamTimeout(str(e)) if isinstance(e, TimeoutError) else UpstreamFailed(f"{type(e).__name__}: {e}")
            )
            body.abort()
            return None


def cut_off(body: RawBody) -> None:
    """The relay failed on the gateway's side (a bug, not the worker's failure): logged, and
    the client's connection cut, as nothing more can be written to it in order."""
    log.exception("relaying a worker's answer failed on the gateway's side; the client's connection is cut")
    body.abort()


async def _cancel_on_disconnect(receive, task: asyncio.Task) -> None:
    """Cancel `task` when its client disconnects (the request body is read by then)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


def sse_error(message: str, type_: str = "server_error", code: str = "worker_failed") -> bytes:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
