"""Sending one request to one worker: pooled connections, the wait for its answer, failures.

The client is the gateway's own (gateway/upstream.py: an asyncio protocol, httptools), where
aiohttp's reader cost a future and a task wakeup per streamed event. Upstream responses are
returned once their head has arrived, and a stream is read up to its first token event
(`first_token`) before anything reaches the client; a committed answer is then relayed to the
client as the worker writes it (gateway/relay.py). Closing an
upstream response early closes its connection, which is how a client's disconnect reaches the
worker (the worker aborts a request whose client went away).

Every wait on a worker is bounded: connecting (`connect_timeout`), a stream's start and first
token event (`first_byte_timeout`), and silence inside a stream, or a relayed answer's body
(`BodyPassThrough`), after that (`idle_timeout`). A completion's or chat's non-streaming answer
comes whole, after its last token, so its wait is the whole generation: it is bounded by
`answer_timeout` (`open(whole=True)`), long by default as sglang-router's and vllm-router's
request timeout (1800 s) is, since 4096 tokens at 35 ms each on a busy worker (143 s) is a
legitimate answer, not a fault; a worker that really hangs is taken out sooner by liveness
(below: an engine making no progress, `/state` failing). A P/D prefill leg's, a tokenization's
or a pooling request's answer is whole too but no more work than a prefill, so it keeps the
first-byte bound.
A wait is also cut short when the worker is lost (the fleet's liveness check resolves a
future) or the client disconnects. Any failure before the answer is committed to the client
is an `UpstreamError` for the caller to retry elsewhere (but an `AnswerTimeout`: its class
says why); what follows a commitment is gateway/relay.py's.
"""

import asyncio
import time

from starlette.requests import Request

from gateway.tap import StreamTap
from gateway.upstream import UPSTREAM_KEEPALIVE_S, Pool, Upstream
from workers.http_guard import wait_disconnect

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


class AnswerTimeout(UpstreamTimeout):
    """A whole answer did not come within the answer timeout. Not retried: the worker is
    likely still generating it (a hung one is taken out by liveness first), and another would
    take as long, doubling the load when the fleet is slowest; the client gets a 504."""


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
    def __init__(
        self,
        connect_timeout: float = 2.0,
        first_byte_timeout: float = 120.0,
        idle_timeout: float = 30.0,
        answer_timeout: float = 1800.0,
    ):
        self.pool = Pool(connect_timeout, UPSTREAM_KEEPALIVE_S)
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        self.answer_timeout = answer_timeout

    async def close(self) -> None:
        self.pool.close()

    async def open(
        self,
        url: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        client: Request | None = None,
        lost: asyncio.Future | None = None,
        whole: bool = False,
        method: str = "POST",
    ) -> Upstream:
        """Send the request (a POST unless `method` says, `body` None for none) and wait for the
        response head (the body stays unread), within the first-byte timeout, or with `whole`
        (an answer that comes only when its last token is made) the answer timeout, past which
        `AnswerTimeout`.

        A non-streaming worker answers only when the whole completion is done, so with
        `client` given the wait is abandoned (`ClientGone`, upstream connection closed, the
        worker aborts) as soon as that client disconnects; likewise when `lost` resolves.
        """
        bound = self.answer_timeout if whole else self.first_byte_timeout
        try:
            async with Watch(bound, client, lost):
                return await self.pool.request(method, url, path, headers, body)
        except UpstreamTimeout:
            if whole:
                raise AnswerTimeout(f"the worker did not finish its answer within {bound:g} s") from None
            raise
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
        tap: StreamTap,
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
