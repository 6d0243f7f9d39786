"""The HTTP server of the gateway and the workers (uvicorn + httptools on uvloop), hardened
against clients: a connection cap, a head size cap and header/body/idle/send timeouts.

uvicorn gives an idle keep-alive timeout (`timeout_keep_alive`); it has no cap on a request
head's size under httptools, no timeout for a request head or body that trickles in, starts no
timer at all on a fresh connection that says nothing, and answers its own `limit_concurrency`
with a plain-text 503. So each connection here is a `ClientConnection`:

- a request head must arrive whole within `header_timeout_s` of its first byte (of the
  connection, for a new one), and its body within `body_timeout_s` of the head, extended by a
  second per `body_min_rate` bytes received up to `body_max_timeout_s` (Apache mod_reqtimeout's
  `body=30-600,MinRate=500000`); otherwise the client gets a 408 and the connection is closed,
  so trickling clients cannot hold sockets while a large body that keeps flowing (a P/D export
  to `/kv/import`) is never cut;
- a request head over `max_head_bytes` gets a 431 and the connection is closed, so a head that
  never ends cannot grow without bound within its deadline;
- a client that leaves its answer unread (its socket buffer full, the server's writes
  paused) for `send_timeout_s` has its connection cut, and a stream's worker aborts the
  request, so clients that never read cannot hold answers, worker slots and connections;
- beyond `max_connections` open connections, a new one is answered with an OpenAI-shaped 503
  and `Retry-After` (then closed) instead of being served, well before file descriptors run out.

`add_client_args` gives both CLIs the same flags, `client_limits` reads them and
`server_config` builds uvicorn's config from the limits. Torch-free: the gateway imports it
(and extends `ClientConnection` with its raw body, gateway/raw_send.py). SIGTERM drains either
server through `workers.drain.DrainingServer`.
"""

import argparse
import asyncio
import json
import logging
import resource
from collections.abc import Mapping
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from workers.protocol import error_body

HEADER, BODY = "header", "body"
log = logging.getLogger("kvgate.http")


@dataclass(frozen=True)
class ClientLimits:
    """What one server allows its clients (the defaults are the CLIs')."""

    max_connections: int = 4096
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 5.0
    retry_after_s: int = 1
    max_head_bytes: int = 64 * 1024
    send_timeout_s: float = 60.0
    body_min_rate: int = 500_000  # bytes/s
    body_max_timeout_s: float = 600.0

    def body_seconds(self, received: int) -> float:
        """Seconds a request body may take after its head with `received` bytes of it in:
        `body_timeout_s` plus a second per `body_min_rate` bytes (none for a rate of 0), at most
        `body_max_timeout_s` (never less than `body_timeout_s`). A body flowing at the min rate
        or faster is cut only at that ceiling, a trickle soon after `body_timeout_s`: large
        bodies need no long timeout that slow clients could hold sockets with."""
        if self.body_min_rate <= 0:
            return self.body_timeout_s
        ceiling = max(self.body_timeout_s, self.body_max_timeout_s)
        return min(self.body_timeout_s + received / self.body_min_rate, ceiling)


def fit_connections(wanted: int, files_each: int) -> int:
    """`wanted`, or fewer if this process may not open that many files: each client connection
    may take `files_each` of them (the gateway's may need an upstream one), so clients get at
    most that share of the file limit, less 256 for polls, Redis and logs. The soft file limit
    is raised to the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if soft == resource.RLIM_INFINITY:
        return wanted
    return min(wanted, max(16, (soft - 256) // files_each))


def _raw_error(status: int, reason: str, message: str, type_: str, code: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, for when no request cycle
    is there to answer through."""
    body = json.dumps(error_body(message, type_, code)).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def over_capacity(retry_after: int):
    """An ASGI app answering every request with 503 `overloaded` and closing the connection."""
    body = json.dumps(
        error_body("the server has too many open connections; retry later", "server_error", "overloaded")
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(retry_after).encode()),
        (b"connection", b"close"),
    ]

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


class ClientConnection(HttpToolsProtocol):
    """uvicorn's httptools protocol with head/body deadlines, a head size cap and the connection
    cap (`limits` is set on the subclass `protocol_class` makes). httptools (llhttp, in C) parses
    a request for a fraction of h11's CPU, which was the largest cost of a proxied request."""

    limits: ClientLimits = ClientLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.phase: str | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.in_message = False  # a request's first byte has come, its last not yet
        self.head_bytes = 0
        self.body_bytes = 0  # of the request whose body is coming, since `body_since` (loop time)
        self.body_since = 0.0
        self.stall: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections:
            self.app = over_capacity(self.limits.retry_after_s)
        self._guard(HEADER, self.limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.phase == HEADER or not self.in_message:
            self.head_bytes += len(data)
        super().data_received(data)
        if self.phase == HEADER and self.in_message and self.head_bytes > self.limits.max_head_bytes:
            self._unguard()
            if not self.transport.is_closing():
                self.transport.write(
                    _raw_error(
                        431,
                        "Request Header Fields Too Large",
                        f"the request head is over {self.limits.max_head_bytes} bytes",
                        "invalid_request_error",
                        "request_head_too_large",
                    )
                )
                self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.in_message = True
        if self.phase != HEADER:
            self._guard(HEADER, self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self.head_bytes = 0
        self.body_bytes = 0
        self.body_since = self.loop.time()
        self._guard(BODY, self.limits.body_timeout_s)

    def on_body(self, body: bytes) -> None:
        """Count the body's bytes: they extend its deadline (`_extend_body`)."""
        self.body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.in_message = False
        self._unguard()

    def connection_lost(self, exc: Exception | None) -> None:
        self._unguard()
        self._unstall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The client's buffer is full: it has `send_timeout_s` to read some of it, or the
        connection is cut. A client that never reads would otherwise hold its answer, its
        worker's slot and a connection for as long as it likes."""
        super().pause_writing()
        if self.stall is None:
            self.stall = self.loop.call_later(self.limits.send_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self._unstall()
        super().resume_writing()

    def _unstall(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None

    def _stalled(self) -> None:
        """The client read nothing of its answer for `send_timeout_s`: drop the connection (the
        app hears a disconnect: a worker's stream aborts its request, and the gateway's closes
        its upstream, whose worker does the same)."""
        self.stall = None
        log.info("client %s read nothing for %g s: connection closed", self.client, self.limits.send_timeout_s)
        self.transport.abort()

    def _guard(self, phase: str, seconds: float) -> None:
        self._unguard()
        self.phase = phase
        self.deadline = self.loop.call_later(seconds, self._expired)

    def _unguard(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.phase, self.deadline = None, None

    def _expired(self) -> None:
        """The request head or body did not arrive in time: 408 (when nothing was answered yet
        and something was asked) and close; a body's deadline moves on first if the bytes it
        received since extend it."""
        phase = self.phase
        if phase == BODY and self._extend_body():
            return
        self.phase, self.deadline = None, None
        if self.transport.is_closing():
            return
        started = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if self.in_message and not started:
            seconds = self.limits.header_timeout_s if phase == HEADER else self.limits.body_seconds(self.body_bytes)
            self.transport.write(
                _raw_error(
                    408,
                    "Request Timeout",
                    f"the request {phase} did not arrive within {round(seconds, 1):g} s",
                    "invalid_request_error",
                    "request_timeout",
                )
            )
        self.transport.close()

    def _extend_body(self) -> bool:
        """Re-arm the body's deadline at what the bytes received allow (`ClientLimits.body_seconds`);
        False when that has passed too. Checked only when the deadline fires, so a body's bytes
        cost a count, not a timer each."""
        left = self.body_since + self.limits.body_seconds(self.body_bytes) - self.loop.time()
        if left <= 0:
            return False
        self.deadline = self.loop.call_later(left, self._expired)
        return True


def protocol_class(limits: ClientLimits, base: type[ClientConnection] = ClientConnection) -> type[ClientConnection]:
    """`base` with `limits`: uvicorn makes one protocol per connection from a class, not a factory."""
    return type(base.__name__, (base,), {"limits": limits})


def add_client_args(g: argparse._ArgumentGroup, notes: Mapping[str, str] | None = None) -> None:
    """The client-connection flags (`client_limits` reads them), with the defaults of
    `ClientLimits`; `notes` adds a server's own remark to a flag's help, by flag name. One
    definition, so the gateway and the workers cannot drift apart."""
    notes = notes or {}
    default = ClientLimits()

    def add(flag: str, value: float, help_: str, **kw) -> None:
        note = f"; {notes[flag]}" if flag in notes else ""
        g.add_argument(flag, type=type(value), default=value, help=help_ + note, **kw)

    add(
        "--max-connections",
        default.max_connections,
        "open client connections; beyond, a new one is answered 503 and closed (lowered to fit the file limit)",
    )
    add(
        "--client-header-timeout",
        default.header_timeout_s,
        "seconds for a request head to arrive whole (else 408 and close)",
        metavar="S",
    )
    add(
        "--client-body-timeout",
        default.body_timeout_s,
        "seconds for a request body to arrive whole after its head (else 408 and close), "
        "extended by --client-body-min-rate",
        metavar="S",
    )
    add(
        "--client-body-min-rate",
        default.body_min_rate,
        "bytes/s: each this many body bytes received add a second to --client-body-timeout, so a "
        "body that keeps flowing this fast is never cut before --client-body-max-timeout while a "
        "trickle still is (0: no extension); 500 kB/s is far below any LAN transfer, and holding "
        "4096 connections open at it would cost a client 2 GB/s",
        metavar="B/S",
    )
    add(
        "--client-body-max-timeout",
        default.body_max_timeout_s,
        "seconds a request body may take at most, however fast it flows: the ceiling of "
        "--client-body-min-rate's extension (300 MB at 500 kB/s)",
        metavar="S",
    )
    add(
        "--client-idle-timeout", default.idle_timeout_s, "seconds an idle keep-alive connection stays open", metavar="S"
    )
    add(
        "--client-send-timeout",
        default.send_timeout_s,
        "seconds a client may leave its answer unread (the server's writes paused) before the connection is cut",
        metavar="S",
    )


def client_limits(args: argparse.Namespace, files_each: int, retry_after_s: int) -> ClientLimits:
    """The limits `add_client_args`'s flags set, the connection cap fitted to the file limit
    (`fit_connections`), and the Retry-After of the cap's 503."""
    return ClientLimits(
        fit_connections(args.max_connections, files_each),
        args.client_header_timeout,
        args.client_body_timeout,
        args.client_idle_timeout,
        retry_after_s,
        send_timeout_s=args.client_send_timeout,
        body_min_rate=args.client_body_min_rate,
        body_max_timeout_s=args.client_body_max_timeout,
    )


def server_config(
    app: ASGIApp,
    limits: ClientLimits,
    host: str,
    port: int,
    log_level: str,
    protocol: type[ClientConnection] = ClientConnection,
    access_log: bool = False,
) -> uvicorn.Config:
    """uvicorn's config for `app` served by `protocol` with `limits` (httptools on uvloop: a
    fraction of h11's and asyncio's CPU per request); uvicorn's own keep-alive timeout is the
    idle one."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        http=protocol_class(limits, protocol),
        loop="uvloop",
        timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]  # a float: it goes to call_later
        timeout_graceful_shutdown=5,
    )
