"""HTTP hygiene toward hostile clients, for the gateway's and the workers' ASGI apps.

`read_body` refuses a body past a size limit before reading it (by its Content-Length) or as
soon as it grows past the limit (chunked), so a 10 MB prompt never reaches memory, let alone
the tokenizer. `CloseOn5xx` marks every 5xx `Connection: close` and turns an exception that
escapes the app into an OpenAI-shaped 500: without it uvicorn drops the connection after
such a response without saying so, and the client's next request on it fails.
"""

import json
import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from workers.protocol import error_body

log = logging.getLogger("kvgate.http")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


async def wait_disconnect(request: Request) -> None:
    """Until the client of a request whose body has been read goes away: what a streaming
    response watches to stop generating for no one."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-shaped error response."""
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


class BodyTooLarge(Exception):
    """The request body is larger than the server takes (a 413)."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than this server takes ({limit} bytes)")
        self.limit = limit


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or BodyTooLarge as soon as it is known to exceed `limit` bytes (`_chunks`)."""
    return b"".join(await _chunks(request, limit))


async def read_body_writable(request: Request, limit: int) -> bytearray:
    """`read_body` as a bytearray, in the one copy joining it takes: a K/V payload in it becomes
    a tensor without another."""
    return bytearray().join(await _chunks(request, limit))


async def _chunks(request: Request, limit: int) -> list[bytes]:
    """The body's chunks, or BodyTooLarge as soon as it is known to exceed `limit` bytes: from
    its Content-Length (ASCII digits) before reading any of it, else when the bytes read pass
    the limit."""
    length = request.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return chunks


class CloseOn5xx:
    """ASGI middleware: a 5xx response carries `Connection: close`; an exception from the app
    becomes a 500 if no response has started, is only logged if one has finished, and is
    re-raised (the connection is cut, as it must be) if one is half sent."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        progress = {"started": False, "finished": False}

        async def send_closing(message: dict) -> None:
            if message["type"] == "http.response.start":
                progress["started"] = True
                if message["status"] >= 500:
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                progress["finished"] = True
            await send(message)

        try:
            await self.app(scope, receive, send_closing)
        except Exception as e:
            if progress["started"] and not progress["finished"]:
                raise
            log.exception("internal error on %s", scope.get("path"))
            if not progress["started"]:
                await _send_500(send_closing, e)


async def _send_500(send, e: Exception) -> None:
    body = json.dumps(error_body(f"internal error: {type(e).__name__}", "server_error", "internal_error")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 500,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


ERROR_CODES = {404: "not_found", 405: "method_not_allowed"}


async def json_http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404 (no such path) and 405 (wrong method) as OpenAI error objects."""
    if not isinstance(exc, HTTPException):
        raise exc
    path = request.url.path[:200]
    message = {404: f"no such endpoint: {path}", 405: f"{request.method} is not allowed on {path}"}.get(
        exc.status_code, str(exc.detail)
    )
    return JSONResponse(
        error_body(message, "invalid_request_error", ERROR_CODES.get(exc.status_code)),
        status_code=exc.status_code,
        headers=exc.headers,
    )


JSON_HTTP_ERRORS = {HTTPException: json_http_error}
