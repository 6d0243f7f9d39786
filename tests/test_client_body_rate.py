"""A request body that keeps flowing at `--client-body-min-rate` or faster outlives the body
timeout (workers/http_server.py `ClientLimits.body_seconds`), so a large P/D export reaches a
decode worker's /kv/import over a slow link; a trickle still gets its 408, and so does a body
past `--client-body-max-timeout`. The gateway's and a worker's servers take the flags."""

import asyncio
import json
import select
import socket

import pytest
import uvicorn
import uvloop

from tests.client_configs import Configure, gateway_config, limited, worker_config
from workers.http_server import ClientLimits

KIB = 1024


async def count_body(scope, receive, send) -> None:
    """Read the request's body whole and answer its length."""
    if scope["type"] != "http":
        return
    got, more = 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return
        got, more = got + len(message.get("body", b"")), message.get("more_body", False)
    body = str(got).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def post(address: tuple[str, int], chunks: int, chunk: bytes, every_s: float) -> bytes:
    """POST `chunks` copies of `chunk`, one every `every_s` s, sending no more once an answer
    comes (a 408 cuts the body short); returns the raw answer."""
    with socket.create_connection(address) as s:
        s.sendall(
            b"POST / HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % (chunks * len(chunk))
        )
        for _ in range(chunks):
            if select.select([s], [], [], every_s)[0]:
                break
            try:
                s.sendall(chunk)
            except OSError:  # the server closed after its 408
                break
        return read_all(s)


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (or resets a connection it closed with the
    body's last bytes unread); a generous bound on a wait that should end."""
    s.settimeout(60)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def serve(configure: Configure, chunks: int, chunk: bytes, every_s: float) -> tuple[int, dict | int]:
    """Serve `count_body` to one `post`; returns the answer's status and its JSON body."""

    async def main() -> bytes:
        listener = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(configure(count_body))
        serving = asyncio.ensure_future(server.serve(sockets=[listener]))
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            return await asyncio.wait_for(asyncio.to_thread(post, listener.getsockname(), chunks, chunk, every_s), 120)
        finally:
            server.should_exit = True
            await serving

    head, body = uvloop.run(main()).split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


# 64 KiB every 0.1 s for 3 s: ten times the min rate of 64 KiB/s, three times the body timeout
STEADY = {"chunks": 30, "chunk": b"x" * 64 * KIB, "every_s": 0.1}
FLAGS = ("--client-body-timeout", "1", "--client-body-min-rate", str(64 * KIB))


@pytest.mark.parametrize(
    "configure",
    [
        limited(ClientLimits(body_timeout_s=1.0, body_min_rate=64 * KIB)),
        worker_config(*FLAGS),
        gateway_config(*FLAGS),
    ],
    ids=["server", "worker", "gateway"],
)
def test_a_body_flowing_above_the_min_rate_outlives_the_body_timeout(configure):
    assert serve(configure, **STEADY) == (200, 30 * 64 * KIB)


def assert_timed_out(answer: tuple[int, dict | int], seconds: str) -> None:
    status, body = answer
    assert status == 408 and isinstance(body, dict)
    assert body["error"]["code"] == "request_timeout"
    assert body["error"]["message"] == f"the request body did not arrive within {seconds} s"


def test_without_a_min_rate_the_same_body_is_cut_at_the_body_timeout():
    assert_timed_out(serve(limited(ClientLimits(body_timeout_s=1.0, body_min_rate=0)), **STEADY), "1")


def test_a_trickling_body_gets_408():
    """100 bytes every 0.1 s earn 1/65 s a second: cut soon after the body timeout."""
    limits = ClientLimits(body_timeout_s=1.0, body_min_rate=64 * KIB)
    assert_timed_out(serve(limited(limits), chunks=50, chunk=b"x" * 100, every_s=0.1), "1")


def test_a_body_flowing_past_the_max_timeout_gets_408():
    limits = ClientLimits(body_timeout_s=0.5, body_min_rate=64 * KIB, body_max_timeout_s=1.5)
    assert_timed_out(serve(limited(limits), chunks=40, chunk=b"x" * 64 * KIB, every_s=0.1), "1.5")


def test_body_seconds_add_a_second_per_min_rate_bytes_up_to_the_ceiling():
    limits = ClientLimits(body_timeout_s=30.0, body_min_rate=1000, body_max_timeout_s=600.0)
    assert limits.body_seconds(0) == 30.0
    assert limits.body_seconds(5000) == 35.0
    assert limits.body_seconds(10**9) == 600.0
    assert ClientLimits(body_timeout_s=30.0, body_min_rate=0).body_seconds(10**9) == 30.0
    assert ClientLimits(body_timeout_s=30.0, body_max_timeout_s=10.0).body_seconds(10**9) == 30.0
