"""Forwarding one request to one worker: pooled connections, pass-through streams, failures.

Upstream responses are opened with `stream=True` so a stream's events reach the client as the
worker writes them. Closing an upstream response early closes its connection, which is how a
client's disconnect reaches the worker (the worker aborts a request whose client went away).
A failure before the response starts is the caller's to retry elsewhere (`ConnectFailed`); a
failure mid-stream ends that stream with an SSE error event and `[DONE]`.
"""
import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"
_CACHED = re.compile(rb'"cached_tokens":\s*(\d+)')


class ConnectFailed(Exception):
    """The worker could not be reached, or dropped the connection before answering."""


class ClientGone(Exception):
    """The client disconnected before the worker answered."""


class UpstreamFailed(Exception):
    """The worker broke off a response it had started."""


class Proxy:
    def __init__(self, connect_timeout: float = 2.0):
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout, read=None, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024, keepalive_expiry=30.0))

    async def close(self) -> None:
        await self.client.aclose()

    async def open(self, url: str, path: str, body: bytes, headers: dict[str, str],
                   client: Request | None = None) -> httpx.Response:
        """Send the request and wait for the response head (the body stays unread).

        A non-streaming worker answers only when the whole completion is done, so with
        `client` given the wait is abandoned (`ClientGone`, upstream connection closed, the
        worker aborts) as soon as that client disconnects.
        """
        req = self.client.build_request("POST", url + path, content=body, headers=headers)
        send = asyncio.ensure_future(self.client.send(req, stream=True))
        gone = asyncio.ensure_future(_wait_disconnect(client)) if client is not None else None
        try:
            if gone is not None:
                await asyncio.wait({send, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not send.done():
                    raise ClientGone()
            return await send
        except httpx.TransportError as e:
            raise ConnectFailed(f"{type(e).__name__}: {e}") from e
        finally:
            send.cancel()
            if gone is not None:
                gone.cancel()

    async def read(self, resp: httpx.Response) -> bytes:
        """The whole body of a response whose head has arrived; closes it."""
        try:
            return await resp.aread()
        except httpx.TransportError as e:
            raise UpstreamFailed(f"{type(e).__name__}: {e}") from e
        finally:
            await _close(resp)


class StreamTap:
    """What the gateway learns from a stream in passing: time to first token, cached tokens."""

    def __init__(self, kind: str, started: float):
        self.started = started
        self.events_before_token = 2 if kind == "chat" else 1  # chat opens with a role-only event
        self.events = 0
        self.ttft: float | None = None
        self.cached: int | None = None

    def feed(self, chunk: bytes) -> None:
        if self.ttft is None:
            self.events += chunk.count(b"data: ")
            if self.events >= self.events_before_token:
                self.ttft = time.monotonic() - self.started
        if b"cached_tokens" in chunk:
            self.cached = cached_tokens(chunk)


def cached_tokens(body: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` from a response body or usage event."""
    m = _CACHED.search(body)
    return int(m.group(1)) if m else None


async def relay(resp: httpx.Response, tap: StreamTap,
                on_error: Callable[[Exception], str]) -> AsyncIterator[bytes]:
    """Pass an SSE stream through as it arrives.

    Only a trailing partial event is held back until its end arrives, so that if the worker
    dies the client gets whole events followed by a clean error event and `[DONE]`.
    `on_error` is told about the failure and returns the message to send.
    """
    partial = b""
    try:
        async for chunk in resp.aiter_raw():
            if partial:
                chunk, partial = partial + chunk, b""
            if not chunk.endswith(b"\n\n"):
                end = chunk.rfind(b"\n\n")
                cut = end + 2 if end >= 0 else 0
                chunk, partial = chunk[:cut], chunk[cut:]
                if not chunk:
                    continue
            tap.feed(chunk)
            yield chunk
        if partial:
            yield partial
    except httpx.TransportError as e:
        message = on_error(UpstreamFailed(f"{type(e).__name__}: {e}"))
        yield sse_error(message)
        yield DONE
    finally:
        await _close(resp)


class PassThrough(StreamingResponse):
    """A streamed upstream response that is closed, and `on_close` run, however the stream
    ends: finished, failed, cancelled by a client disconnect, or never started because the
    client was gone before the first byte."""

    def __init__(self, content: AsyncIterator[bytes], upstream: httpx.Response, on_close: Callable[[], None],
                 headers: dict[str, str]):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.upstream, self.on_close = upstream, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _close(self.upstream)
            self.on_close()


def sse_error(message: str, type_: str = "server_error", code: str = "worker_failed") -> bytes:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _close(resp: httpx.Response) -> None:
    """Close the upstream response even while the calling task is being cancelled."""
    with anyio.CancelScope(shield=True):
        await resp.aclose()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
