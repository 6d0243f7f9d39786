"""CloseOn5xx and read_body on a real uvicorn server (in a thread, on a free loopback port)."""

import http.client
import json
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.procs import free_port, wait_for
from workers.http_guard import BodyTooLarge, CloseOn5xx, read_body


class RaisesAfterSending(Response):
    """A response that is sent whole, then fails (as a stream's cleanup might)."""

    async def __call__(self, scope, receive, send) -> None:
        await super().__call__(scope, receive, send)
        raise RuntimeError("after the response")


async def boom(request: Request) -> Response:
    raise RuntimeError("a bug")


async def late(request: Request) -> Response:
    return RaisesAfterSending(b"ok")


async def unavailable(request: Request) -> Response:
    return JSONResponse({"error": {"message": "busy"}}, status_code=503, headers={"connection": "keep-alive"})


async def ok(request: Request) -> Response:
    return JSONResponse({"ok": True})


async def echo(request: Request) -> Response:
    try:
        return Response(await read_body(request, 1000))
    except BodyTooLarge as e:
        return JSONResponse({"error": str(e)}, status_code=413)


def serve(app) -> tuple[str, int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    threading.Thread(target=server.run, daemon=True).start()
    wait_for(lambda: server.started, what="uvicorn up")
    return server, port


@pytest.fixture(scope="module")
def guarded():
    routes = [
        Route("/boom", boom),
        Route("/late", late),
        Route("/unavailable", unavailable),
        Route("/ok", ok),
        Route("/echo", echo, methods=["POST"]),
    ]
    server, port = serve(Starlette(routes=routes, middleware=[Middleware(CloseOn5xx)]))
    yield port
    server.should_exit = True
    time.sleep(0.2)


def get(conn: http.client.HTTPConnection, path: str) -> tuple[int, http.client.HTTPMessage, bytes]:
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, resp.headers, resp.read()


def test_an_exception_is_an_openai_500_that_closes_its_connection(guarded):
    conn = http.client.HTTPConnection("127.0.0.1", guarded, timeout=10)
    status, headers, body = get(conn, "/boom")
    assert status == 500 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "internal_error" and "a bug" not in body.decode()
    assert conn.sock is None  # announced, so the client reconnects instead of failing
    assert get(conn, "/ok")[0] == 200


def test_every_5xx_closes_and_a_finished_response_keeps_its_connection(guarded):
    conn = http.client.HTTPConnection("127.0.0.1", guarded, timeout=10)
    status, headers, _ = get(conn, "/unavailable")
    assert status == 503 and headers.get_all("connection") == ["close"] and conn.sock is None
    status, _, body = get(conn, "/late")  # the failure after the response is only logged
    sock = conn.sock
    assert status == 200 and body == b"ok" and sock is not None
    assert get(conn, "/ok")[0] == 200 and conn.sock is sock


def test_read_body_stops_at_the_limit(guarded):
    conn = http.client.HTTPConnection("127.0.0.1", guarded, timeout=10)
    conn.request("POST", "/echo", body=b"x" * 1000)
    assert conn.getresponse().read() == b"x" * 1000
    conn.request("POST", "/echo", body=b"x" * 1001)
    resp = conn.getresponse()
    assert resp.status == 413 and b"1000 bytes" in resp.read()
    conn.request("POST", "/echo", body=iter([b"x" * 600, b"x" * 600]), encode_chunked=True)  # no length
    resp = conn.getresponse()
    assert resp.status == 413 and resp.read()
    conn.request("POST", "/echo", body=b"after")  # the refused bodies' rest was discarded
    assert conn.getresponse().read() == b"after"


def test_without_the_guard_uvicorn_drops_the_connection_unannounced():
    """What CloseOn5xx prevents: Starlette's error handler answers 500, re-raises, and uvicorn
    then closes the connection though the response never said so."""
    server, port = serve(
        Starlette(
            routes=[Route("/boom", boom), Route("/ok", ok)],
            exception_handlers={Exception: lambda r, e: JSONResponse({}, status_code=500)},
        )
    )
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        status, headers, _ = get(conn, "/boom")
        assert status == 500 and headers["connection"] != "close" and conn.sock is not None
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            get(conn, "/ok")
    finally:
        server.should_exit = True
