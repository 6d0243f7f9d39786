"""A worker stand-in for tests/test_upstream.py that misbehaves on cue, run as its own process:
`python tests/scripted_upstream.py PORT`. Paths: POST /stream (a whole stream), POST /slow (20
events 5 ms apart), POST /whole
(a JSON answer kept alive, the connection closed by the server after 0.3 s idle, as uvicorn
does after its 5 s), POST /drop (a stream cut after two events), POST /hang (a stream silent after one event; its connection's
closing is counted), POST /late (a whole JSON answer after LATE_S, as a worker sends a
non-streaming completion; a connection closed before it is counted), GET /log (the counts as
JSON), GET /health."""

import asyncio
import json
import sys

import httptools

IDLE_CLOSE_S = 0.3
LATE_S = 1.0
LATE_BODY = b'{"usage":{"completion_tokens":40}}'
DONE = b"data: [DONE]\n\n"
EVENT = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
counts = {"whole_connections": 0, "hang_closed": 0, "late_cut": 0}


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def answer(status: str, body: bytes, close: bool = False) -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return (head + ("connection: close\r\n" if close else "") + "\r\n").encode() + body


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Conn(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.transport, self.parser, self.url, self.served = transport, httptools.HttpRequestParser(self), b"", set()
        self.idle: asyncio.TimerHandle | None = None
        self.late: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if self.idle is not None:
            self.idle.cancel()
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        path = self.url.decode()
        if path == "/whole":
            if "whole" not in self.served:
                counts["whole_connections"] += 1
            self.transport.write(answer("200 OK", b'{"usage":{"completion_tokens":1}}'))
            self.idle = asyncio.get_running_loop().call_later(IDLE_CLOSE_S, self.transport.close)
        elif path == "/stream":
            self.transport.write(STREAM_HEAD + chunk(EVENT) + chunk(EVENT))
            self.transport.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif path == "/slow":
            self.transport.write(STREAM_HEAD + chunk(EVENT))
            for i in range(1, 20):
                asyncio.get_running_loop().call_later(0.005 * i, self.transport.write, chunk(EVENT))
            asyncio.get_running_loop().call_later(0.2, self.transport.write, chunk(DONE) + b"0\r\n\r\n")
        elif path == "/drop":
            self.transport.write(STREAM_HEAD + chunk(EVENT) + chunk(EVENT))
            asyncio.get_running_loop().call_later(0.05, self.transport.abort)
        elif path == "/hang":
            self.transport.write(STREAM_HEAD + chunk(EVENT))
        elif path == "/late":
            self.late = asyncio.get_running_loop().call_later(LATE_S, self.answer_late)
        elif path == "/log":
            self.transport.write(answer("200 OK", json.dumps(counts).encode(), close=True))
            self.transport.close()
        else:
            self.transport.write(answer("200 OK", b"{}", close=True))
            self.transport.close()
        self.served.add(path.strip("/"))

    def answer_late(self) -> None:
        self.late = None
        self.transport.write(answer("200 OK", LATE_BODY))

    def connection_lost(self, exc) -> None:
        if "hang" in self.served:
            counts["hang_closed"] += 1
        if self.late is not None:  # closed by the client before its answer
            counts["late_cut"] += 1
            self.late.cancel()


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Conn, "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
