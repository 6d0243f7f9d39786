"""A client that leaves its answer unread has its connection cut (workers/http_server.py), so it
cannot hold an answer, a worker's slot and a connection for as long as it likes; a client that
reads, however slowly, keeps it. `kvgate worker`'s server cuts it too."""

import asyncio
import socket
import time
from collections.abc import Callable

import uvicorn
import uvloop

from tests.client_configs import Configure, limited, worker_config
from workers.http_server import ClientLimits

MIB = 1 << 20


def serve(configure: Configure, chunks: int, read: Callable[[socket.socket], int]) -> tuple[bool, int, int]:
    """Serve one response of `chunks` MiB to a client that `read`s it (in a thread); returns
    (whether the app heard the client's disconnect, bytes the client read, connections left open)."""

    async def main() -> tuple[bool, int, int]:
        cut = finished = False
        done = asyncio.Event()

        async def app(scope, receive, send) -> None:
            nonlocal finished
            if scope["type"] != "http":
                return  # a worker's config asks for lifespan events: none needed here
            await receive()  # the request's (empty) body

            async def hear_disconnect() -> None:
                nonlocal cut
                cut = (await receive())[
                    "type"
                ] == "http.disconnect" and not finished  # an answered request reads as one

            heard = asyncio.ensure_future(hear_disconnect())
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            try:
                for _ in range(chunks):
                    await send({"type": "http.response.body", "body": b"x" * MIB, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                finished = True
            finally:
                await asyncio.sleep(0)
                heard.cancel()
                done.set()

        listener = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(configure(app))
        serving = asyncio.ensure_future(server.serve(sockets=[listener]))
        client = socket.socket()
        if read is never:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the buffers fill sooner
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            client.connect(listener.getsockname())
            client.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            reading = asyncio.ensure_future(asyncio.to_thread(read, client))
            await asyncio.wait_for(done.wait(), 120)
            got = await asyncio.wait_for(reading, 120)
            return cut, got, len(server.server_state.connections)
        finally:
            client.close()
            server.should_exit = True
            await serving

    return uvloop.run(main())


def never(client: socket.socket) -> int:
    return 0


def slowly(client: socket.socket) -> int:
    """Read the whole answer 256 KiB at a time, 0.1 s apart: never a pause near the timeout."""
    got = 0
    client.settimeout(60)
    while chunk := client.recv(256 * 1024):
        got += len(chunk)
        if b"0\r\n\r\n" in chunk[-5:]:
            break
        time.sleep(0.1)
    return got


def test_a_client_that_never_reads_is_cut_off_and_the_app_stops_sending():
    cut, _, left = serve(limited(ClientLimits(send_timeout_s=0.2)), chunks=1024, read=never)
    assert cut and left == 0  # without the cut the app waits on its first full buffer for good


def test_a_client_that_reads_slowly_keeps_its_connection_to_the_end():
    cut, got, _ = serve(limited(ClientLimits(send_timeout_s=2.0)), chunks=16, read=slowly)
    assert not cut and got > 16 * MIB  # every MiB, with its chunked framing


def test_a_worker_cuts_a_client_that_never_reads():
    """A client talking to a worker directly meets the worker's --client-send-timeout."""
    cut, _, left = serve(worker_config("--client-send-timeout", "0.2"), chunks=1024, read=never)
    assert cut and left == 0
