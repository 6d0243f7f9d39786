"""The gateway's OpenAI front door (starlette): tokenize, decide, forward, account.

A request is parsed and tokenized exactly as a worker would (so bad input fails here with the
worker's own OpenAI error), hashed into blocks, matched against the residency index, and
handed with the fleet's in-memory view to the policy; the chosen worker gets the client's
original bytes. Admission control refuses what the fleet cannot take in time (503/429 with
`Retry-After`). A worker that fails a request before its answer is committed to the client
(a non-streaming answer, or a stream before its first token) costs a retry on another
worker; each worker's circuit breaker counts its failures.

Every request gets the gateway's own id, and a client's own `x-request-id` is only echoed back
and logged (gateway/request_ids.py). Bodies past `max_body_bytes` are refused before they are
read, internal fields (`kv_transfer`) are refused, and every 5xx closes its connection
(`CloseOn5xx`).

`/tokenize`, `/detokenize`, `/v1/embeddings` and vLLM's other pooling endpoints need no routing
decision: they are forwarded to the least loaded worker of their model under the same door, limits and retries
(gateway/forward.py, which says why tokenization is the worker's and not the gateway's); so does
`/v1/responses`, but a stored response's requests go to the worker that holds it (gateway/responses.py).
"""

import contextlib
import dataclasses
import logging
import time

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.accounting import Accounting
from gateway.admission import DRAINING, Admission
from gateway.auth import Access, Guard
from gateway.exchange import PATHS, Exchange
from gateway.fleet import Fleet
from gateway.pooling import POOLING_KINDS
from gateway.forward import DETOKENIZE, TOKENIZE, Forwarder
from gateway.forward import PATHS as FORWARDED
from gateway.worker import Worker
from gateway.index import ResidencyIndex
from gateway.intake import ApiError, Intake, refused
from gateway.metrics import GatewayMetrics, RedisCollector
from gateway.peer_decisions import PeerDecisions
from gateway.responses import RESPONSES_KINDS, TRACE_NAMES, Responses, routes
from gateway.local_responses import LocalResponses
from gateway.response_ids import ResponseIds
from gateway.response_store import ResponseStore
from gateway.shared_response_ids import SharedResponseIds
from gateway.proxy import Proxy
from gateway.record import RequestRecord
from gateway.request_ids import client_request_id, gateway_request_id
from gateway.relay import PassThrough
from gateway.retry import RetryPolicy, Tries, Way
from gateway.routing import Routing
from gateway.tokenize import Prepared, Tokenizers
from gateway.tracing import Tracing
from policies.api import FleetView, Policy, RequestView
from policies.api import Route as Decision
from policies.candidates import NO_WORKERS
from workers.internal_auth import internal_headers
from workers.http_guard import DEFAULT_MAX_BODY_BYTES, JSON_HTTP_ERRORS, BodyTooLarge, CloseOn5xx, read_body
from workers.protocol import error_body

log = logging.getLogger("kvgate.gateway")


class Gateway:
    def __init__(
        self,
        fleet: Fleet,
        tokenizers: Tokenizers,
        policy: Policy,
        proxy: Proxy | None = None,
        redis=None,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
        pd_wait_ms: float = 5000.0,
        tracing: Tracing | None = None,
        access: Access | None = None,
        internal_token: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        admission: Admission | None = None,
        retry: RetryPolicy | None = None,
        access_log: bool = True,
        fleet_summary_s: float = 0.0,
        response_ids: ResponseIds | None = None,
        shared_response_ids: SharedResponseIds | None = None,
        response_store: ResponseStore | None = None,
    ):
        self.fleet = fleet
        self.admission = admission or Admission()
        self.retry = retry or RetryPolicy()
        self.internal_token = internal_token
        self.max_body_bytes = max_body_bytes
        self.tracing = tracing or Tracing()
        self.pd_wait_ms = pd_wait_ms
        self.index: ResidencyIndex = fleet.index
        self.tokenizers = tokenizers
        self.policy = policy
        self.proxy = proxy or Proxy()
        self.redis = redis
        self.metrics = GatewayMetrics(fleet, policy.name)
        self.account = Accounting(self.metrics, fleet, policy.name, access_log, fleet_summary_s)
        self.access = access or Access()
        self.access.register(self.metrics.registry)
        self.intake = Intake(fleet, tokenizers, self.access, slo_ttft_ms, slo_tpot_ms, bool(internal_token))
        self.exchange = Exchange(fleet, self.proxy, self.metrics, self.account, self.headers, pd_wait_ms)
        self.forwarder = Forwarder(
            fleet, self.proxy, self.admission, self.retry, self.metrics, self.exchange, self.intake, tokenizers
        )
        self.tries = Tries(self.retry, self.metrics, self.exchange, self.admission)
        store = response_store if response_store is not None else ResponseStore()  # an empty one is falsy
        local = LocalResponses(
            lambda r, raw, rec: self.generate(r, "chat", raw, rec), store, self.fleet.generation_defaults
        )
        ids = response_ids if response_ids is not None else ResponseIds()
        self.responses = Responses(self.forwarder, ids, shared_response_ids, local)
        if redis is not None:
            peers = PeerDecisions(fleet, policy)
            redis.ledgers.on_routed, redis.ledgers.on_tally = peers.observe_routed, peers.add_tally
            self.metrics.registry.register(RedisCollector(redis))
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                *(Route(FORWARDED[kind], self.endpoint(kind), methods=["POST"]) for kind in sorted(POOLING_KINDS)),
                *routes(self.endpoint),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/v1/models/{model:path}", self.retrieve_model),
                Route("/health", self.health),
                Route("/metrics", self.prometheus),
            ],
            lifespan=self._lifespan,
            exception_handlers=JSON_HTTP_ERRORS,
            middleware=[Middleware(CloseOn5xx), Middleware(Guard, access=self.access)],
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        await self.fleet.start()
        if self.redis is not None:
            await self.redis.start()
        for name in self.tokenizers.sources:
            await self.tokenizers.get(name)
        self.account.start()
        try:
            yield
        finally:
            await self.account.stop()
            if self.redis is not None:
                await self.redis.stop()
            await self.fleet.stop()
            await self.proxy.close()
            await self.access.limiter.close()
            await self.responses.close()
            self.tracing.shutdown()

    def headers(self, worker: str = "", predicted: int = 0) -> dict[str, str]:
        return {
            "x-kvgate-worker": worker,
            "x-kvgate-policy": self.policy.name,
            "x-kvgate-predicted-cached-tokens": str(predicted),
        }

    def error(self, e: ApiError, worker: str = "") -> JSONResponse:
        headers = self.headers(worker) | e.headers
        if e.retry_after is not None:
            headers["retry-after"] = str(e.retry_after)
        return JSONResponse(error_body(str(e), e.type, e.code, e.param), status_code=e.status, headers=headers)

    async def completions(self, request: Request) -> Response:
        return await self.handle(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self.handle(request, "chat")

    def endpoint(self, kind: str):
        """The endpoint of a pooling kind (POST /v1/embeddings, /v2/embed, /pooling, /classify,
        /score, /rerank...: forwarded to a vLLM worker of the model, gateway/forward.py) or of
        the Responses API (gateway/responses.py)."""

        async def endpoint(request: Request) -> Response:
            return await self.handle(request, kind)

        endpoint.__name__ = kind
        return endpoint

    async def tokenize(self, request: Request) -> Response:
        """vLLM's POST /tokenize, forwarded to a worker of the model (why not answered here:
        gateway/forward.py)."""
        return await self.handle(request, TOKENIZE)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's POST /detokenize, forwarded as /tokenize is."""
        return await self.handle(request, DETOKENIZE)

    async def handle(self, request: Request, kind: str) -> Response:
        """Admit the request (or refuse it at once) and count it until its answer ends."""
        rid = gateway_request_id(kind)
        rec = RequestRecord(rid, kind, time.monotonic(), client_request_id=client_request_id(request))
        refusal = self.admission.refuse()
        if refusal is not None:
            self.metrics.refused.labels(refusal.code).inc()
            refusing = self.error(refused(refusal))
            refusing.headers["x-request-id"] = rec.client_request_id or rec.request_id
            if refusal.code == DRAINING:
                refusing.headers["connection"] = "close"  # keep-alive clients reconnect elsewhere
            rec.status, rec.code = refusing.status_code, refusal.code
            self.account.finish(rec)
            return refusing
        self.admission.enter()
        resp: Response | None = None
        try:
            resp = await self.serve(request, kind, rec)
        finally:
            if isinstance(resp, PassThrough):
                resp.on_close.append(self.admission.leave)
            else:
                self.admission.leave()
        return resp

    async def serve(self, request: Request, kind: str, rec: RequestRecord) -> Response:
        rid, client_rid = rec.request_id, rec.client_request_id
        if client_rid:
            log.info("request %s is the client's x-request-id %r", rid, client_rid)
        name = TRACE_NAMES.get(kind) or f"POST {PATHS.get(kind) or FORWARDED[kind]}"
        trace = rec.trace = self.tracing.start(name, request.headers)
        trace.set(request_id=rid, client_request_id=client_rid)
        try:
            raw = await read_body(request, self.max_body_bytes)
            if kind in FORWARDED:
                resp = await self.forwarder.serve(request, kind, raw, rec)
            elif kind in RESPONSES_KINDS:
                resp = await self.responses.serve(request, kind, raw, rec)
            else:
                resp = await self.generate(request, kind, raw, rec)
        except BodyTooLarge as e:
            resp = self.error(ApiError(413, str(e), code="request_too_large"))
        except ClientDisconnect:  # gone while sending its body (or too slow: the body timeout)
            resp = Response(b"", 499)
        except ApiError as e:
            rec.code = e.code
            resp = self.error(e)
        except Exception as e:  # a bug (say in a plugin policy) still answers in OpenAI's shape
            log.exception("internal error on %s (request %s)", request.url.path, rid)
            resp = self.error(ApiError(500, f"internal error: {type(e).__name__}", "server_error", "internal_error"))
        except BaseException:
            trace.end(500)
            raise
        resp.headers["x-request-id"] = client_rid or rid
        resp.headers["x-kvgate-request-id"] = rid
        if not isinstance(resp, PassThrough):
            rec.status = resp.status_code
            self.account.finish(rec)
        return resp

    async def generate(self, request: Request, kind: str, raw: bytes, rec: RequestRecord) -> Response:
        """A completion or chat request: tokenized, its tokens charged, routed and forwarded."""
        trace = rec.trace
        with trace.phase("tokenize"):
            model, prep, view, raw = await self.intake.prepare(request, raw, kind, rec)
        trace.set(model=model, prompt_tokens=view.num_tokens)
        rec.model, rec.prompt_tokens = model, view.num_tokens
        rec.max_tokens = prep.parsed.params.max_tokens if prep is not None else None
        rec.slo_ttft_ms, rec.slo_tpot_ms = view.slo_ttft_ms, view.slo_tpot_ms
        await self.intake.admit_tokens(request, view, prep)
        return await self.dispatch(request, kind, raw, model, prep, view, rec)

    def decide(
        self, view: RequestView, model: str, exclude: set[str]
    ) -> tuple[Worker, Decision, Worker | None, FleetView]:
        """Match the prompt against the index and ask the policy; all in memory. Returns the
        chosen worker, the route, the prefill worker of a P/D route, and what the policy saw."""
        t0 = time.perf_counter()
        workers = [w for w in self.fleet.candidates(model) if w.worker_id not in exclude]
        retry_after = self.admission.config.retry_after_s
        if not workers:
            raise ApiError(503, NO_WORKERS, "server_error", "no_healthy_workers", retry_after=retry_after)
        room = self.admission.open_workers(workers)
        if not room:
            self.metrics.refused.labels("worker_queues_full").inc()
            raise refused(self.admission.full(len(workers)))
        matches = self.index.match(view.block_hashes)
        fleet = FleetView(
            self.fleet.views(room, matches, self.index.slow_blocks(view.block_hashes, matches)), time.time()
        )
        route = self.policy.route(view, fleet)
        self.metrics.decision.observe(time.perf_counter() - t0)
        if route.tally is not None:
            self.fleet.tallied(route.tally)
        if route.reject:
            if route.reject == NO_WORKERS:
                raise ApiError(503, NO_WORKERS, "server_error", "no_healthy_workers", retry_after=retry_after)
            self.metrics.refused.labels("policy").inc()
            raise ApiError(429, route.reject, "rate_limit_error", "policy_rejected", retry_after=retry_after)
        if route.prefill is not None and (not self.internal_token or view.choices != 1):
            route = dataclasses.replace(route, prefill=None)  # P/D legs need the fleet's token, carry one sequence
        by_id = {w.worker_id: w for w in workers}
        chosen = by_id.get(route.worker) if route.worker else None
        prefill = by_id.get(route.prefill) if route.prefill else None
        if chosen is None or (route.prefill is not None and prefill is None):
            raise ApiError(
                500,
                f"policy {self.policy.name} chose {route.worker!r}/{route.prefill!r}, not candidates",
                "server_error",
                "bad_route",
            )
        return chosen, route, prefill, fleet

    async def dispatch(
        self,
        request: Request,
        kind: str,
        raw: bytes,
        model: str,
        prep: Prepared | None,
        view: RequestView,
        rec: RequestRecord,
    ) -> Response:
        """Decide and forward, retried as `Tries.run` says (gateway/retry.py): each try routed
        by the policy among the workers that have not failed the request (`Routing`)."""
        headers = {"content-type": "application/json", "x-request-id": view.request_id}
        if rec.ids_sent:  # kv_prompt_ids is internal, as kv_transfer is
            headers.update(internal_headers(self.internal_token))
        routing = Routing(self, request, kind, raw, model, prep, view, rec, headers)
        way = Way(routing.pick, routing.attempt, routing.headers, routing.begin, routing.end)
        return await self.tries.run(rec, self.retry.max_retries, way)

    async def models(self, request: Request) -> Response:
        data = [_model_card(m, n) for m, n in sorted(self.fleet.models().items())]
        return JSONResponse({"object": "list", "data": data}, headers=self.headers())

    async def retrieve_model(self, request: Request) -> Response:
        """GET /v1/models/{id}: a model the fleet serves, or a 404."""
        name, models = request.path_params["model"], self.fleet.models()
        if name not in models:
            return self.error(
                ApiError(404, f"The model `{name[:200]}` does not exist.", code="model_not_found", param="model")
            )
        return JSONResponse(_model_card(name, models[name]), headers=self.headers())

    async def health(self, request: Request) -> Response:
        up = sum(w.available for w in self.fleet.workers.values())
        status = "draining" if self.admission.draining else "ok" if up else NO_WORKERS
        body = {
            "status": status,
            "workers": len(self.fleet.workers),
            "healthy": up,
            "pending": self.admission.pending,
            "redis": self.redis.status() if self.redis is not None else "off",
        }
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def prometheus(self, request: Request) -> Response:
        body, ctype = self.metrics.render()
        return Response(body, media_type=ctype)


def _model_card(model: str, max_model_len: int) -> dict:
    return {"id": model, "object": "model", "created": 0, "owned_by": "kvgate", "max_model_len": max_model_len}
