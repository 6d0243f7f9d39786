"""One try of a request on one worker, and its end: the response head, then a non-streaming
answer read whole or a stream relayed from its first token (a prefill leg started first for a
P/D pair). Until something is committed to the client a failure raises `UpstreamError`, which
the gateway retries elsewhere (gateway/retry.py, which also ends the fleet's count and ledger of
a try whose answer is not relayed); on every way a try ends the worker's breaker and the
metrics are kept, and a relayed stream's count and ledger end with it.
"""

import json
import logging
import time
from collections.abc import Callable

from opentelemetry.trace import Span
from starlette.requests import Request
from starlette.responses import Response

from gateway import pd
from gateway.accounting import Accounting
from gateway.fleet import Fleet
from gateway.worker import Worker
from gateway.metrics import GatewayMetrics
from gateway.proxy import (
    ConnectFailed,
    Proxy,
    UpstreamError,
    UpstreamFailed,
    UpstreamTimeout,
    WorkerBusy,
    WorkerError,
)
from gateway.record import PREFILL, RequestRecord
from gateway.relay import PassThrough, Relay
from gateway.tap import StreamTap, whole_answer
from gateway.tokenize import Prepared
from gateway.upstream import Upstream
from policies.api import RequestView
from policies.api import Route as Decision

log = logging.getLogger("kvgate.gateway")

PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


class Exchange:
    """Tries on workers through `proxy`, counted in `fleet`, `metrics` and `account`;
    `headers(worker, predicted)` the gateway's own response headers."""

    def __init__(
        self,
        fleet: Fleet,
        proxy: Proxy,
        metrics: GatewayMetrics,
        account: Accounting,
        headers: Callable[[str, int], dict[str, str]],
        pd_wait_ms: float,
    ) -> None:
        self.fleet, self.proxy, self.metrics, self.account = fleet, proxy, metrics, account
        self.headers, self.pd_wait_ms = headers, pd_wait_ms

    async def attempt(
        self,
        request: Request,
        w: Worker,
        route: Decision,
        view: RequestView,
        prep: Prepared | None,
        kind: str,
        payload: bytes,
        headers: dict,
        rec: RequestRecord,
    ) -> Response:
        """One try on `w`: the response head, then a non-streaming body whole or a stream up to
        its first token. Raises `UpstreamError` while nothing is committed to the client; a
        non-streaming answer's head is its end, awaited within the answer timeout."""
        lost = self.fleet.lost(w)
        started = time.monotonic()
        resp = await self.proxy.open(w.url, PATHS[kind], payload, headers, request, lost, whole=not rec.stream)
        out = self.headers(w.worker_id, route.predicted_cached_tokens)
        out["x-kvgate-route-reason"] = header_text(rec.route_reason)
        out["x-kvgate-candidates"] = rec.candidates
        if route.prefill is not None:
            out["x-kvgate-prefill-worker"] = route.prefill
        is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        if not ((prep.parsed.stream if prep else is_sse) and resp.status == 200):
            return await self.collect(w, route, view, resp, out, started, rec)
        tap = StreamTap(kind, rec.arrived, rec.hide_usage, prep.parsed.num_choices if prep else 1)
        try:
            head = await self.proxy.first_token(resp, tap, request, lost, started)
        except BaseException:
            resp.release()
            raise
        self.fleet.started(w, rec.request_id, time.time())
        w.breaker.succeeded()  # the answer is committed to the client: the worker's success
        return self.stream(w, resp, tap, head, out, rec)

    def start_prefill(
        self, p: Worker, d: Worker, kind: str, raw: bytes, headers: dict, rec: RequestRecord, route: Decision
    ) -> tuple[bytes, Span]:
        """Start the prefill leg on `p` in the background; returns the decode leg's body for `d`
        and the leg's span. The leg's cache hit is counted against what the policy predicted."""
        body = json.loads(raw)
        self.fleet.begin(p)
        headers = dict(headers)
        span = rec.trace.child("prefill_leg", headers, worker=p.worker_id)
        model, prompt, predicted = rec.model, rec.prompt_tokens or 0, route.predicted_cached_tokens

        def done(cached: int | None) -> None:
            span.set_attribute("kvgate.ok", cached is not None)
            span.end()
            self.fleet.end(p)
            self.metrics.prefill_legs.labels(model, p.worker_id, "ok" if cached is not None else "failed").inc()
            if cached is not None:
                self.metrics.hit(model, p.worker_id, PREFILL, prompt, predicted, cached)

        pd.start_prefill(self.proxy, p.url, PATHS[kind], pd.prefill_leg(body, d.url), headers, done)
        return pd.decode_leg(body, self.pd_wait_ms), span

    def worker_failed(self, w: Worker, e: UpstreamError, engine: bool = True) -> str:
        """Count a worker's failure: metrics, its breaker, and (when it could not be reached or
        broke a response off) exclusion until its next good health poll. `engine`: the request
        ran on the worker's engine, whose failures the breaker counts; a tokenization's
        (`gateway/forward.py`) is told to the breaker only when the worker could not be reached
        or broke its answer off, which says the same of its engine's requests."""
        self.metrics.upstream_failures.labels(w.model or "", w.worker_id, e.stage).inc()
        unreachable = type(e) in (ConnectFailed, UpstreamFailed)
        if isinstance(e, WorkerBusy):
            if engine:
                w.breaker.released()
        elif (engine or unreachable) and w.breaker.failed():
            log.warning(
                "worker %s: circuit breaker open after %d failures (last: %s)", w.worker_id, w.breaker.consecutive, e
            )
        if unreachable:
            self.fleet.mark_suspect(w, str(e))
        return f"worker {w.worker_id} failed: {e}"

    async def collect(
        self, w: Worker, route: Decision, view: RequestView, resp, headers: dict, started: float, rec: RequestRecord
    ) -> Response:
        """A non-streaming answer, read whole before anything reaches the client (so a failure
        while reading it is still retried); a 503 is the worker's load and any other 5xx its
        failure, both retried elsewhere."""
        status = resp.status
        body = await whole_body(self.proxy, resp)
        w.breaker.succeeded()
        if status == 200:
            whole_answer(rec, body, resp.headers, started)
        return Response(body, status, headers, resp.headers.get("content-type", "application/json"))

    def stream(self, w: Worker, resp, tap: StreamTap, head: bytes, headers: dict, rec: RequestRecord) -> Response:
        rec.status = 200

        def failed(e: Exception) -> str:
            rec.status = 502
            self.metrics.upstream_failures.labels(w.model or "", w.worker_id, "stream").inc()
            w.breaker.failed()
            if not isinstance(e, UpstreamTimeout):  # broken off: likely dead until its next good poll
                self.fleet.mark_suspect(w, str(e))
            return f"worker {w.worker_id} failed: {e}"

        def closed() -> None:
            self.fleet.end(w, rec.request_id)
            rec.first_token_at, rec.last_token_at = tap.first_at, tap.last_at
            rec.cached_tokens, rec.output_tokens, rec.finish_reason = tap.cached, tap.output_tokens, tap.finish_reason
            self.account.finish(rec)

        headers["cache-control"] = "no-cache"
        return PassThrough(resp, Relay(tap, head), self.proxy.idle_timeout, failed, closed, headers)


async def whole_body(proxy: Proxy, resp: Upstream) -> bytes:
    """A worker's whole answer; a 503 (its load) raises `WorkerBusy` and any other 5xx (its
    failure) `WorkerError`, for the caller to retry elsewhere."""
    status = resp.status
    body = await proxy.read(resp)
    if status == 503:
        raise WorkerBusy(
            status, body, {k: v for k, v in resp.headers.items() if k.lower() in ("retry-after", "content-type")}
        )
    if status >= 500:
        raise WorkerError(status, body)
    return body


def header_text(text: str, limit: int = 300) -> str:
    """`text` as a header value: printable ASCII only (a plugin's reason may hold anything)."""
    text = text[:limit]
    if text.isascii() and text.isprintable():  # " " to "~": the usual reason, as it is
        return text
    return "".join(ch if " " <= ch <= "~" else "?" for ch in text)
