"""Retrying a request that a worker failed before its answer was committed to the client.

Until the client has seen a byte of the answer (a non-streaming response, or a stream before
its first token event) the request can go to another worker as if the first had never been
tried. Each retry waits a backoff first, doubling from `backoff_s` with jitter (so requests
that failed together do not return together), capped at `max_backoff_s`.

`Tries.run` is that rule, the one loop of every request sent to a worker: completions and chat,
routed by the policy (gateway/app.py), and the forwarded endpoints and the Responses API
(gateway/forward.py); what differs between them is their `Way`.
"""

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.responses import Response

from gateway.admission import Admission
from gateway.exchange import Exchange
from gateway.intake import ApiError, worker_failed
from gateway.metrics import GatewayMetrics
from gateway.proxy import AnswerTimeout, ClientGone, UpstreamError, WorkerBusy
from gateway.record import RequestRecord
from gateway.relay import PassThrough
from gateway.worker import Worker
from policies.candidates import NO_WORKERS


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 2
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def delay(self, retry: int, rng: random.Random = random._inst) -> float:
        """Seconds to wait before retry number `retry` (1, 2, ...)."""
        base = min(self.backoff_s * 2 ** (retry - 1), self.max_backoff_s)
        return base * rng.uniform(0.5, 1.0)


def uncounted(w: Worker) -> None:
    """A try that is not counted in flight (not engine work)."""


@dataclass(frozen=True)
class Way:
    """One request's way to the workers, for `Tries.run`.

    `pick(exclude)`: the worker of the next try, not one of `exclude` (those that failed it);
    None when none is left; an ApiError refuses the request. `attempt(w)`: one try on `w`,
    raising `UpstreamError` while nothing is committed to the client. `headers(w)`: the
    gateway's own headers on what it answers itself about `w`'s try (a 499), or with None
    about the request (a worker's 503 passed on). `begin(w)`/`end(w)`: a try counted in flight
    until its answer ends. `engine`: the request is engine work, which the worker's breaker
    counts (a tokenization's failure tells it only when the worker was unreachable)."""

    pick: Callable[[set[str]], Worker | None]
    attempt: Callable[[Worker], Awaitable[Response]]
    headers: Callable[[Worker | None], dict[str, str]]
    begin: Callable[[Worker], None] = uncounted
    end: Callable[[Worker], None] = uncounted
    engine: bool = True


class Tries:
    """Runs requests' tries with the gateway's retry policy, retry metrics, failure accounting
    (`Exchange.worker_failed`) and Retry-After (`admission`'s)."""

    def __init__(self, retry: RetryPolicy, metrics: GatewayMetrics, exchange: Exchange, admission: Admission):
        self.retry, self.metrics, self.exchange, self.admission = retry, metrics, exchange, admission

    async def run(self, rec: RequestRecord, retries: int, way: Way) -> Response:
        """Tries on the workers `way.pick` offers: one that fails before the answer is committed
        costs a retry on another (after a backoff), up to `retries` of them, but for a whole
        answer past the answer timeout (`AnswerTimeout`, the client's 504: gateway/proxy.py says
        why). A try ends when its answer does: at once, or a relayed one (`PassThrough`) when its
        body ends. A client gone is a 499; no worker at all a 503 `no_healthy_workers`; every
        try failed, the last worker's 503 as it was (its load), else the gateway's 502."""
        exclude: set[str] = set()
        failure: UpstreamError | None = None
        retry_after = self.admission.config.retry_after_s
        for n in range(retries + 1):
            if failure is not None:  # each later try follows a failure
                self.metrics.retries.labels(failure.stage).inc()
                rec.retries = n
                await asyncio.sleep(self.retry.delay(n))
            w = way.pick(exclude)
            if w is None:
                if failure is not None:
                    break
                raise ApiError(503, NO_WORKERS, "server_error", "no_healthy_workers", retry_after=retry_after)
            rec.worker = w.worker_id
            way.begin(w)
            if way.engine:
                w.breaker.attempt()
            answer: Response | None = None
            try:
                answer = await way.attempt(w)
                return answer
            except ClientGone:
                if way.engine:
                    w.breaker.released()
                return Response(b"", 499, way.headers(w))
            except UpstreamError as e:
                self.exchange.worker_failed(w, e, way.engine)
                exclude.add(w.worker_id)
                failure = e
                if isinstance(e, AnswerTimeout):
                    break
            except BaseException:
                if way.engine:
                    w.breaker.released()
                raise
            finally:
                if not isinstance(answer, PassThrough):  # a relayed answer ends when its body does
                    way.end(w)
        rec.worker = ""  # the fleet's answer, not one worker's
        if isinstance(failure, WorkerBusy):
            return Response(failure.body, failure.status, {**way.headers(None), **failure.headers})
        raise worker_failed(len(exclude), failure, retry_after)
