"""HTTP/1.1 to the workers on the gateway's own asyncio protocol: a keep-alive connection pool,
responses parsed by httptools (llhttp, in C), and a streamed body pushed from `data_received`.

Why not aiohttp, as before: a relayed stream paid aiohttp's reader for every event (its
parser's Python side, a StreamReader, a future, a task wakeup, a read timer) and a request
paid its ClientSession machinery; here an event runs one callback that writes it on to the
client (`Upstream.pipe`), and a request is one write of a head built in a line. Measured
(experiments/gateway_cpu.py, A/B against aiohttp, 3 rounds): 8.1 -> 6.9 ms of gateway CPU
per 16-token streamed request.

The rules aiohttp's connector kept, kept: a connection is reused only after a whole response
that allows keep-alive, and only within `keepalive_s` of its last use (under the workers' own
5 s, `UPSTREAM_KEEPALIVE_S`); closing a response before its end closes its
connection, which is how the worker learns that its client went away.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

# An idle pooled connection to a worker is dropped after this, before the worker drops it:
# uvicorn's keep-alive timeout (our workers', vLLM's, SGLang's) is 5 s, and reusing a
# connection the server is closing fails the request ("Can not write request body") and made
# the worker suspect; about one request in 25 at 2 req/s over 4 workers.
UPSTREAM_KEEPALIVE_S = 4.0


class SinkFailed(Exception):
    """A piped body's sink (the gateway's side of a relay, the client's end) raised: the
    gateway's failure, never the worker's, so it is not a `ConnectionError`."""


class Upstream(asyncio.Protocol):
    """One connection to a worker, carrying one request at a time; after `send`, `head` resolves
    with the response's status and headers (lowercased names) and the body is read with
    `read_some`, `read_all` or `pipe`. A broken connection or response is a `ConnectionError`."""

    def __init__(self, pool: "Pool", key: tuple[str, int]):
        self.pool, self.key = pool, key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used_at = 0.0

    def send(self, data: bytes) -> None:
        """Start a request: `data` is its whole head and body."""
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head: asyncio.Future[None] = self.loop.create_future()
        self.body: list[bytes] = []
        self.complete = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[bytes], bool] | None = None
        self.blocked = False
        self.last_data = self.loop.time()
        assert self.transport is not None
        self.transport.write(data)

    # the protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport

    def data_received(self, data: bytes) -> None:
        self.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, AttributeError) as e:  # AttributeError: bytes with no request
            self._fail(ConnectionError(f"bad response from the worker: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if not getattr(self, "complete", True):
            self._fail(ConnectionResetError(f"the worker closed the connection{f': {exc}' if exc else ''}"))

    # httptools' callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.sink is not None and not self.blocked and self.error is None:
            try:
                if not self.give(body):
                    self.blocked = True
                    self._wake()
            except SinkFailed:
                pass  # the pipe's waiter has it; raised here it would read as the worker's bad response
        else:
            self.body.append(body)
            self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep = self.parser.should_keep_alive()
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, e: Exception) -> None:
        """The response failed: the first failure is the one its reader is told of (a closed
        connection follows most)."""
        if self.error is None:
            self.error = e
        if not self.head.done():
            self.head.set_exception(e)
            self.head.exception()  # retrieved: the request's waiter may be gone already
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(e)

    # reading

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def read_some(self) -> bytes:
        """What arrived of the body since the last read, waiting for some; b"" at its end."""
        while not self.body and not self.complete:
            await self._wait()
        data, self.body = b"".join(self.body), []
        return data

    async def read_all(self) -> bytes:
        """The rest of the body."""
        while not self.complete:
            await self._wait()
        return self.read_buffered()

    def read_buffered(self) -> bytes:
        data, self.body = b"".join(self.body), []
        return data

    async def pipe(self, sink: Callable[[bytes], bool], drain: Callable[[], Awaitable], idle_s: float) -> None:
        """Pass the rest of the body to `sink` as it arrives, from `data_received` itself, until
        its end. `sink` returns False when its reader is full: reading stops until `drain()`
        returns, and the pipe ends only after that, so a sink may hold what it took until its
        `drain` (response_tap.TappedBody). Raises `TimeoutError` after `idle_s` seconds without
        a byte (time spent waiting on a full reader does not count; `bound_idle` changes the
        bound), `ConnectionError` if the response breaks off, `SinkFailed` if `sink` raises (the
        connection is closed)."""
        self.sink, self.idle_s = sink, idle_s
        self.idle_handle = self.loop.call_at(self.last_data + idle_s, self._idle)
        try:
            if self.body:
                self.blocked = not self.give(self.read_buffered())
            while self.blocked or not self.complete:
                if self.blocked:
                    await self._unblock(drain)
                else:
                    await self._wait()
            if self.error is not None:  # the sink failed on the body's last bytes
                raise self.error
        finally:
            self.idle_handle.cancel()
            self.sink = None

    def give(self, data: bytes) -> bool:
        """`data` to the pipe's sink: what it returns, or `SinkFailed` if it raises, after which
        the response has failed and its connection is closed (the rest of the body unread)."""
        assert self.sink is not None
        try:
            return self.sink(data)
        except Exception as e:
            failure = SinkFailed(f"{type(e).__name__}: {e}")
            self._fail(failure)
            self.close()
            raise failure from e

    def bound_idle(self, idle_s: float) -> None:
        """A running pipe's silence is bounded by `idle_s` from now on, counted from its last byte."""
        self.idle_s = idle_s
        self.idle_handle.cancel()
        self.idle_handle = self.loop.call_at(self.last_data + idle_s, self._idle)

    async def _unblock(self, drain: Callable[[], Awaitable]) -> None:
        """Stop reading until the sink's reader has room, and has taken what came meanwhile."""
        assert self.transport is not None
        if not self.closed:
            self.transport.pause_reading()
        while self.blocked:
            await drain()
            self.last_data = self.loop.time()
            self.blocked = bool(self.body) and not self.give(self.read_buffered())
        if not self.closed:
            self.transport.resume_reading()

    def _idle(self) -> None:
        due = self.last_data + self.idle_s
        if self.blocked or self.loop.time() < due:
            self.idle_handle = self.loop.call_at(max(due, self.loop.time() + 0.001), self._idle)
            return
        self._fail(TimeoutError(f"no data for {self.idle_s:g} s"))

    def release(self) -> None:
        """Done with the response: the connection goes back to the pool when the response came
        whole and allows it, else it is closed (the worker sees the disconnect and aborts the
        request). Synchronous, so a cancelled task still does it."""
        if self.complete and self.keep and not self.closed and self.error is None:
            self.pool.put(self)
        else:
            self.close()

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections to workers, by (host, port), reused last-in first-out."""

    def __init__(self, connect_timeout: float, keepalive_s: float):
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self.idle: dict[tuple[str, int], list[Upstream]] = {}
        self.hosts: dict[str, tuple[tuple[str, int], str, bytes]] = {}

    async def post(self, url: str, path: str, body: bytes, headers: dict[str, str]) -> Upstream:
        """Send a POST and wait for its response's head (`request`)."""
        return await self.request("POST", url, path, headers, body)

    async def get(self, url: str, path: str, headers: dict[str, str]) -> Upstream:
        """Send a GET (`path` with its query) and wait for its response's head (`request`)."""
        return await self.request("GET", url, path, headers)

    async def request(
        self, method: str, url: str, path: str, headers: dict[str, str], body: bytes | None = None
    ) -> Upstream:
        """Send a request and wait for its response's head. Raises `ConnectionError` (or
        `TimeoutError` for the connect) if it cannot; a cancelled wait closes the connection."""
        key, base, host = self._target(url)
        fields = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if fields.count("\n") != len(headers) or fields.count("\r") != len(headers):
            raise ValueError("a header holds a line break")
        length = f"content-length: {len(body)}\r\n" if body is not None else ""
        head = f"{method} {base}{path} HTTP/1.1\r\n{fields}{length}"
        conn = self._take(key) or await self._connect(key)
        conn.send(b"".join((head.encode("latin-1"), host, body or b"")))
        try:
            await conn.head
        except BaseException:
            conn.close()
            raise
        return conn

    def put(self, conn: Upstream) -> None:
        conn.used_at = time.monotonic()
        self.idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: Upstream) -> None:
        """Drop a connection that closed while idle in the pool."""
        conns = self.idle.get(conn.key)
        if conns and conn in conns:
            conns.remove(conn)
            if not conns:
                del self.idle[conn.key]

    def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()

    def _take(self, key: tuple[str, int]) -> Upstream | None:
        conns = self.idle.get(key)
        now = time.monotonic()
        while conns:
            conn = conns.pop()
            if now - conn.used_at < self.keepalive_s and conn.usable():
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int]) -> Upstream:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await loop.create_connection(lambda: Upstream(self, key), *key)
        return conn

    def _target(self, url: str) -> tuple[tuple[str, int], str, bytes]:
        """(host, port), the base path and the `host` header line of a worker's URL, parsed once."""
        if url not in self.hosts:
            parts = urlsplit(url)
            host, port = parts.hostname or "127.0.0.1", parts.port or 80
            self.hosts[url] = ((host, port), parts.path.rstrip("/"), f"host: {parts.netloc}\r\n\r\n".encode())
        return self.hosts[url]
