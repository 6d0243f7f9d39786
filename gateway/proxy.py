"""Forwarding one request to one worker: pooled connections, pass-through streams, failures.

The client is the gateway's own (gateway/upstream.py: an asyncio protocol, httptools), where
aiohttp's reader cost a future and a task wakeup per streamed event. Upstream responses are
returned once their head has arrived; a committed stream's events are then written to the
client from the upstream connection's `data_received`, as the worker writes them. Closing an
upstream response early closes its connection, which is how a client's disconnect reaches the
worker (the worker aborts a request whose client went away).

Every wait on a worker is bounded: connecting (`connect_timeout`), the answer's first byte
(`first_byte_timeout`: a non-streaming answer comes whole, so this bounds the whole request;
a stream's first token event), and silence inside a stream, or a relayed answer's body
(`BodyPassThrough`), after that (`idle_timeout`).
A wait is also cut short when the worker is lost (the fleet's liveness check resolves a
future) or the client disconnects. Any failure before the answer is committed to the client
is an `UpstreamError` for the caller to retry elsewhere; a failure in a committed stream ends
it with an SSE error event and `[DONE]`, in a relayed answer's body by cutting the client's
connection.
"""

import asyncio
import json
import re
import time
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.raw_send import RAW_SEND, RawBody
from gateway.record import RequestRecord
from gateway.upstream import UPSTREAM_KEEPALIVE_S, Pool, Upstream
from workers.http_guard import wait_disconnect
from workers.protocol import TTFT_HEADER

DONE = b"data: [DONE]\n\n"
_CACHED = re.compile(rb'"cached_tokens":\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')
_FINISH = re.compile(rb'"finish_reason":\s*"(\w+)"')
_TOKEN_EVENT = re.compile(rb'"choices":\s*\[\s*\{')  # an event carrying a choice (the usage event has none)
# error events a worker sends when its engine (not the request) failed: another may serve it
ENGINE_GONE = (b'"engine_stopped"', b'"engine_stalled"')


class UpstreamError(Exception):
    """A worker failed a request: `stage` says where (connect, timeout, lost, response, stream)."""

    stage = "response"


class ConnectFailed(UpstreamError):
    """The worker could not be reached, or dropped the connection before answering."""

    stage = "connect"


class UpstreamTimeout(ConnectFailed):
    """The worker did not start its answer within the first-byte timeout."""

    stage = "timeout"


class WorkerLost(ConnectFailed):
    """The fleet took the worker out (engine dead or stalled, /state failing) while we waited."""

    stage = "lost"


class UpstreamFailed(UpstreamError):
    """The worker broke off a response it had started, or fell silent past the idle timeout."""


class StreamFailed(UpstreamFailed):
    """The worker's stream said, before its first token, that its engine is gone."""

    stage = "error_event"


class WorkerBusy(UpstreamError):
    """The worker answered 503 (its queue is full, or it drains): load, not failure; the
    request goes elsewhere, and if nowhere is left the worker's answer is the client's."""

    stage = "busy"

    def __init__(self, status: int, body: bytes, headers: dict[str, str]):
        super().__init__(f"answered {status}")
        self.status, self.body, self.headers = status, body, headers


class WorkerError(UpstreamError):
    """The worker answered a server error other than 503 (500, 502, 504, ...): its failure,
    not the request's, so the request goes elsewhere, and a client whose every try failed gets
    the gateway's 502, never a worker's own 5xx."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"answered {status}: {body[:200].decode('utf-8', 'replace')}")
        self.status = status


class ClientGone(Exception):
    """The client disconnected before the worker answered."""


class Proxy:
    def __init__(self, connect_timeout: float = 2.0, first_byte_timeout: float = 120.0, idle_timeout: float = 30.0):
        self.pool = Pool(connect_timeout, UPSTREAM_KEEPALIVE_S)
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout

    async def close(self) -> None:
        self.pool.close()

    async def open(
        self,
        url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        client: Request | None = None,
        lost: asyncio.Future | None = None,
    ) -> Upstream:
        """Send the request and wait for the response head (the body stays unread).

        A non-streaming worker answers only when the whole completion is done, so with
        `client` given the wait is abandoned (`ClientGone`, upstream connection closed, the
        worker aborts) as soon as that client disconnects; likewise when `lost` resolves.
        """
        try:
            async with Watch(self.first_byte_timeout, client, lost):
                return await self.pool.post(url, path, body, headers)
        except OSError as e:  # refused, reset, a connect timeout
            raise ConnectFailed(f"{type(e).__name__}: {e}") from e

    async def read(self, resp: Upstream) -> bytes:
        """The whole body of a response whose head has arrived; its connection goes back to the
        pool, or is closed if the body could not be read."""
        try:
            async with asyncio.timeout(self.idle_timeout):  # the answer has started: no need to watch `lost`
                return await resp.read_all()
        except OSError as e:  # TimeoutError too
            raise UpstreamFailed(f"{type(e).__name__}: {e}") from e
        finally:
            resp.release()

    async def first_token(
        self,
        resp: Upstream,
        tap: "StreamTap",
        client: Request | None,
        lost: asyncio.Future | None,
        started: float,
    ) -> bytes:
        """Read a stream up to and including its first token event (or an error event, or
        `[DONE]`): what was read so far, which nobody has seen yet. Raises `UpstreamError` (the
        stream is still the caller's to retry elsewhere) or `ClientGone`."""
        head, partial = b"", b""
        async with Watch(started + self.first_byte_timeout - time.monotonic(), client, lost):
            while tap.ttft is None:
                try:
                    chunk = await resp.read_some()
                except OSError as e:
                    raise UpstreamFailed(f"{type(e).__name__}: {e}") from e
                if not chunk:  # a whole stream ends with an event ([DONE]) that would have committed it
                    raise UpstreamFailed("the stream ended before its first token")
                partial += chunk
                whole = partial.rfind(b"\n\n") + 2
                if whole:
                    events, partial = partial[:whole], partial[whole:]
                    if b'"error"' in events and any(code in events for code in ENGINE_GONE):
                        raise StreamFailed(events.decode(errors="replace").strip()[:300])
                    head += tap.feed(events)
        return head + partial


class StreamTap:
    """What the gateway learns from a stream of whole events in passing: when its first and
    last token events came, its finish reason, and its usage (output and cached tokens). A
    usage event the gateway asked for on the client's behalf (`hide_usage`) is read and
    dropped: the client did not ask for it."""

    def __init__(self, kind: str, started: float, hide_usage: bool = False, choices: int = 1):
        self.started = started
        # a chat stream opens with a role-only event per choice
        self.events_before_token = choices + 1 if kind == "chat" else 1
        self.hide_usage = hide_usage
        self.events = 0
        self.ttft: float | None = None
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.cached: int | None = None
        self.output_tokens: int | None = None
        self.finish_reason: str | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Read a run of whole events; returns what is passed on to the client."""
        now = None
        if self.ttft is None:
            self.events += chunk.count(b"data: ")
            if self.events >= self.events_before_token:
                now = self.first_at = time.monotonic()
                self.ttft = now - self.started
        if _TOKEN_EVENT.search(chunk):
            self.last_at = now if now is not None else time.monotonic()
            if b'"finish_reason":"' in chunk or b'"finish_reason": "' in chunk:
                self.finish_reason = _FINISH.findall(chunk)[-1].decode()
        if b'"usage"' in chunk:
            self.cached = cached_tokens(chunk)
            m = _COMPLETION.search(chunk)
            self.output_tokens = int(m.group(1)) if m else self.output_tokens
            if self.hide_usage:
                *events, rest = chunk.split(b"\n\n")
                chunk = b"".join(e + b"\n\n" for e in events if not _usage_event(e)) + rest
        return chunk


def _usage_event(event: bytes) -> bool:
    """Whether an SSE event carries usage and no choice (the final usage-only event)."""
    return event.startswith(b"data: {") and b'"usage"' in event and not _TOKEN_EVENT.search(event)


def ask_usage(body: dict) -> bool:
    """Make a (validated) streaming request ask for its usage event, which the gateway reads
    for its accounting and then drops (`StreamTap.hide_usage`); True when the client had not
    asked for it itself."""
    opts = body.get("stream_options")
    if body.get("stream") is not True or (isinstance(opts, dict) and opts.get("include_usage") is True):
        return False
    body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return True


def whole_answer(rec: RequestRecord, body: bytes, headers, sent: float) -> None:
    """What a whole (non-streaming) 200 answer tells: usage, finish reason and, from the
    worker's TTFT header, when its first token came (`sent`: when the gateway sent it)."""
    rec.cached_tokens = cached_tokens(body)
    m = _COMPLETION.search(body)
    rec.output_tokens = int(m.group(1)) if m else None
    reasons = _FINISH.findall(body)
    rec.finish_reason = reasons[-1].decode() if reasons else None
    rec.last_token_at = time.monotonic()
    try:
        ttft_ms = float(headers.get(TTFT_HEADER, "nan"))
    except ValueError:
        ttft_ms = float("nan")
    if 0 <= ttft_ms < float("inf"):
        rec.first_token_at = min(sent + ttft_ms / 1000.0, rec.last_token_at)


def cached_tokens(body: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` from a response body or usage event."""
    m = _CACHED.search(body)
    return int(m.group(1)) if m else None


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
        except OSError as e:  # TimeoutError too
            self.on_error(
                UpstreamTimeout(f"no data for {self.idle_timeout:g} s")
                if isinstance(e, TimeoutError)
                else UpstreamFailed(f"{type(e).__name__}: {e}")
            )
            body.abort()
            return None


async def _cancel_on_disconnect(receive, task: asyncio.Task) -> None:
    """Cancel `task` when its client disconnects (the request body is read by then)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


def sse_error(message: str, type_: str = "server_error", code: str = "worker_failed") -> bytes:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Watch:
    """`async with Watch(seconds, client, lost)`: what waits inside is cut short, by cancelling
    the task, when the client disconnects (`ClientGone`) or `lost` resolves (`WorkerLost`);
    past `seconds`, `UpstreamTimeout`. Whatever is abandoned is cancelled, which closes its
    upstream connection. One task (the disconnect watch) per use and none per read, where
    racing each read cost two tasks and an `asyncio.wait`."""

    def __init__(self, seconds: float, client: Request | None, lost: asyncio.Future | None):
        self.timeout = asyncio.timeout(max(0.0, seconds))
        self.client, self.lost = client, lost
        self.why: UpstreamError | ClientGone | None = None
        self.active = False

    async def __aenter__(self) -> "Watch":
        task = asyncio.current_task()
        assert task is not None, "a watch runs in a task"
        self.task, self.active = task, True
        await self.timeout.__aenter__()
        if self.lost is not None:
            self.lost.add_done_callback(self._lost)
        self.gone = asyncio.ensure_future(self._gone(self.client)) if self.client is not None else None
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.active = False  # a callback already scheduled must not cancel what runs next
        if self.lost is not None:
            self.lost.remove_done_callback(self._lost)
        if self.gone is not None:
            self.gone.cancel()
        try:
            await self.timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            raise UpstreamTimeout("the worker did not answer in time") from None
        if exc_type is asyncio.CancelledError and self.why is not None:
            self.task.uncancel()
            raise self.why from None

    def _stop(self, why: UpstreamError | ClientGone) -> None:
        if self.active and self.why is None:
            self.why = why
            self.task.cancel()

    def _lost(self, lost: asyncio.Future) -> None:
        self._stop(WorkerLost(f"the worker was taken out: {lost.result()}"))

    async def _gone(self, client: Request) -> None:
        await wait_disconnect(client)
        self._stop(ClientGone())
