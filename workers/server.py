"""The worker's HTTP API (starlette): OpenAI endpoints plus state, KV events and snapshots.

Every request is keyed in the engine by an id this server makes; a client's own id (its
`x-request-id`, vLLM's body `request_id`) is only shown (response header and body `id`) and logged,
so two requests with one id never meet in the engine. A body's `kv_transfer` is read only
with the fleet's internal token. New requests are refused with 503 + Retry-After while the
engine is stopped, the worker drains, or it already holds `max_num_seqs + max_queued_requests`.
"""

import asyncio
import contextlib
import logging
import time

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.engine import ENGINE_STOPPED, Engine, EngineStopped
from workers.control_routes import ControlRoutes
from workers.job import Job
from workers.job_runner import JobRunner
from workers.given_ids import FIELD as GIVEN_IDS
from workers.given_ids import fingerprint, given_prompts, has_text
from workers.http_guard import (
    DEFAULT_MAX_BODY_BYTES,
    JSON_HTTP_ERRORS,
    BodyTooLarge,
    CloseOn5xx,
    error,
    read_body,
    wait_disconnect,
)
from workers.metrics import RequestClock, WorkerMetrics
from workers.prefix_tokens import PrefixTokenizer
from workers.protocol import CLIENT_ID, MAX_CLIENT_ID, TTFT_HEADER, ParsedRequest, parse_request, tokenize_body
from workers.responses import id_prefix, new_id
from workers.sampling_params import InvalidRequest
from workers.strict_json import loads
from workers.tracing import WorkerTracing
from workers.transfer_http import TransferService
from workers.transfer_metrics import TransferCollector

log = logging.getLogger("kvgate.worker")
# a gateway's body: the client's (up to the gateway's cap) and the prompts' ids, a few bytes each
FLEET_BODY_FACTOR = 16
RETRY_AFTER_S = 1


class WorkerServer:
    """Binds one engine to HTTP. Each request is a `Job` its `runner` hands to the engine and
    reads the answer of."""

    def __init__(
        self,
        engine: Engine,
        served_model: str,
        vocab_size: int,
        internal_token: str | None = None,
        kv_transport: str = "http",
        max_queued_requests: int = 1024,
        stall_timeout_s: float = 5.0,
        tracing: WorkerTracing | None = None,
        nixl_quarantine_s: float | None = None,
    ):
        self.engine = engine
        self.generation_defaults = engine.config.generation_defaults
        self.max_in_flight = engine.config.max_num_seqs + max_queued_requests
        self.stall_timeout_s = stall_timeout_s
        self.draining = False  # set on SIGTERM (workers/drain.py)
        self.transfer = TransferService(engine, served_model, internal_token, kv_transport, nixl_quarantine_s)
        self.model = served_model
        self.vocab_size = vocab_size
        # prompts are tokenized once per distinct prefix; the engine keeps the plain tokenizer. No
        # word cache (~0.3 s to seed at every start): a gateway sends the ids along (kv_prompt_ids)
        tok = engine.tokenizer
        self.prompt_tokenizer = PrefixTokenizer(tok, words=False) if tok is not None else None
        self.tokenizer_id = fingerprint(engine.tokenizer) if engine.tokenizer is not None else None
        self.metrics = WorkerMetrics(engine, served_model)
        self.metrics.registry.register(TransferCollector(self.transfer, served_model))
        self.tracing = tracing or WorkerTracing()
        self.transfer.tracing = self.tracing
        self.publisher = None  # a workers.redis_publisher.RedisPublisher when --redis is given
        self.runner = JobRunner(engine, self.transfer, self.metrics, self.tracing, served_model)
        self.control = ControlRoutes(self)
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/v1/models/{model:path}", self.retrieve_model),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/health", self.health),
                Route("/metrics", self.prometheus),
                *self.control.routes(),
                *self.transfer.routes(),
            ],
            lifespan=self._lifespan,
            middleware=[Middleware(CloseOn5xx)],
            exception_handlers=JSON_HTTP_ERRORS,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.control.start(asyncio.get_running_loop())
        if self.publisher is not None:
            await self.publisher.start()
        yield
        if self.publisher is not None:
            await self.publisher.stop()
        self.engine.stop()
        await self.transfer.close()
        self.tracing.shutdown()

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    @property
    def in_flight(self) -> int:
        """Choices of the requests handed to the engine, not ended (`JobRunner.in_flight`)."""
        return self.runner.in_flight

    @property
    def idle(self) -> bool:
        """Nothing left to finish: no request in the engine, no KV export on its way."""
        return self.in_flight == 0 and self.transfer.sending == 0

    def unavailable(self) -> tuple[str, str] | None:
        """(code, why) when this worker must not be sent requests, else None."""
        if not self.engine.alive:
            return ENGINE_STOPPED, "the engine has stopped"
        if self.draining:
            return "draining", "this worker is shutting down"
        stall = self.engine.stall_s()
        if stall > self.stall_timeout_s:
            return "engine_stalled", f"the engine has not completed a step for {stall:.1f} s"
        return None

    def _refusal(self) -> Response | None:
        """503 + Retry-After when the engine is stopped, the worker drains, or it is full. A
        stalled engine still queues requests (a long step is still a step); /health shows it."""
        why = self.unavailable()
        if why is not None and why[0] == "engine_stalled":
            why = None
        if why is None and self.in_flight >= self.max_in_flight:
            why = "overloaded", f"this worker already holds {self.in_flight} requests"
        if why is None:
            return None
        return self._refuse(*why)

    def _refuse(self, code: str, why: str) -> Response:
        """A new request's 503 + Retry-After, counted by reason."""
        self.metrics.rejected[code].inc()
        return error(503, why, "server_error", code, headers={"retry-after": str(RETRY_AFTER_S)})

    async def _parse(self, request: Request, kind: str) -> ParsedRequest | Response:
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        trusted = self.transfer.authorised(request)
        for name in ("kv_transfer", GIVEN_IDS):
            # ids a worker without a token cannot trust: it tokenizes the prompts itself
            if body.get(name) is not None and not trusted and (name == "kv_transfer" or self.transfer.token):
                return error(
                    403,
                    f"'{name}' is internal: it needs the fleet's internal token",
                    "permission_error",
                    "forbidden",
                    name,
                )
        tok, max_len = self.prompt_tokenizer, self.engine.max_model_len
        try:
            value = body.pop(GIVEN_IDS, None)
            given = given_prompts(value, self.tokenizer_id, self.vocab_size) if trusted and value is not None else None
            if given is None or body.get("bad_words"):  # tokenizing (prompts, bad words): off the event loop
                parsed = await asyncio.to_thread(
                    parse_request, body, kind, tok, max_len, self.vocab_size, None, self.generation_defaults
                )
            else:  # nothing to tokenize: a thread hop would cost more than the checks
                parsed = parse_request(body, kind, tok, max_len, self.vocab_size, given, self.generation_defaults)
        except InvalidRequest as e:
            return error(400, str(e), code=e.code, param=e.param)
        if has_text(body, kind):
            self.metrics.tokenized["gateway" if given is not None else "worker"].inc()
        if parsed.params.logprobs is not None and not self.engine.computes_logprobs:
            return error(
                400,
                "this worker's executor has no token distribution to report logprobs from",
                code="unsupported_parameter",
                param="logprobs",
            )
        return parsed

    async def _body(self, request: Request, model_required: bool = True) -> dict | Response:
        """A JSON object body naming this worker's model (or none, when not `model_required`),
        or the error answering it: a 413 for one past DEFAULT_MAX_BODY_BYTES (the gateway's
        default cap), known before it is read whole, so no client makes it buffer and parse more.
        The fleet's own calls (the internal token) may be FLEET_BODY_FACTOR times that: a gateway
        sends a client's body it has already capped, plus its token ids (`kv_prompt_ids`)."""
        most = DEFAULT_MAX_BODY_BYTES * (FLEET_BODY_FACTOR if self.transfer.authorised(request) else 1)
        try:
            body = loads(await read_body(request, most))
        except ClientDisconnect:  # gone while sending its body (or too slow: the body timeout)
            return Response(b"", 499)
        except BodyTooLarge as e:
            return error(413, str(e), code="request_too_large")
        except InvalidRequest as e:
            return error(400, str(e), code=e.code, param=e.param)
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        if body.get("model") is None:
            if not model_required:
                return body
            return error(400, "'model' is required", param="model")
        if body["model"] != self.model:
            return error(404, f"The model `{body['model']}` does not exist.", code="model_not_found", param="model")
        return body

    async def tokenize(self, request: Request) -> Response:
        """vLLM's POST /tokenize: a completion `prompt` or chat `messages` (through the chat template)
        -> token ids, read with the options the completion and chat endpoints take and refusing
        the fields they refuse (workers/prompt_options.py: `add_special_tokens`, chat's
        `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`,
        `reasoning_effort`, `documents`), with their strings when `return_token_strs`. `model`
        is optional here, as in vLLM."""
        body = await self._body(request, model_required=False)
        if isinstance(body, Response):
            return body
        try:
            ids, strs = await asyncio.to_thread(tokenize_body, body, self.prompt_tokenizer, self.engine.max_model_len)
        except InvalidRequest as e:
            return error(400, str(e), code=e.code, param=e.param)
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.engine.max_model_len,
                "tokens": ids,
                "token_strs": self.engine.tokenizer.convert_ids_to_tokens(ids) if strs else None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        """vLLM's POST /detokenize: `tokens` -> {"prompt": their text}; `model` is optional. At
        most max_model_len tokens, the most any request here holds: decoding more is work for no one."""
        body = await self._body(request, model_required=False)
        if isinstance(body, Response):
            return body
        tokens, limit = body.get("tokens"), self.engine.max_model_len
        if isinstance(tokens, list) and len(tokens) > limit:
            return error(400, f"'tokens' holds {len(tokens)} ids, more than max_model_len ({limit})", param="tokens")
        if not (isinstance(tokens, list) and all(type(t) is int and 0 <= t < self.vocab_size for t in tokens)):
            return error(400, f"'tokens' must be a list of token ids in [0, {self.vocab_size})", param="tokens")
        text = await asyncio.to_thread(self.engine.tokenizer.decode, tokens)
        return JSONResponse({"prompt": text})

    async def _generate(self, request: Request, kind: str) -> Response:
        arrived = time.monotonic()
        refused = self._refusal()
        if refused is not None:
            return refused
        parsed = await self._parse(request, kind)
        if isinstance(parsed, Response):
            return parsed
        key = new_id(kind)
        given = request.headers.get("x-request-id")
        if given:
            log.info("request %s has x-request-id %r", key, given[:MAX_CLIENT_ID])
        if parsed.client_request_id is not None:
            log.info("request %s has request_id %r", key, parsed.client_request_id)
        job = Job(
            key,
            shown_id(key, given, parsed),
            parsed,
            [RequestClock(arrived) for _ in range(parsed.num_choices)],
        )
        job.span = self.tracing.start(f"POST {request.url.path}", request.headers, parsed, key)
        refused = self._refusal() or self._submit(job)
        if refused is not None:
            self.tracing.end(job.span, refused.status_code)
            return refused
        if parsed.stream:
            return StreamingResponse(
                self.runner.stream(job), media_type="text/event-stream", headers={"x-request-id": job.shown}
            )
        status, body = await self.runner.collect(job, wait_disconnect(request))
        return JSONResponse(body, status, self._headers(job))

    def _submit(self, job: Job) -> Response | None:
        """Hand the job to the engine; a 503 if it refuses (it is stopping: its thread may
        still run, so `_refusal` may not know yet)."""
        try:
            self.runner.submit(job)
        except EngineStopped:
            return self._refuse(ENGINE_STOPPED, "the engine has stopped")
        return None

    @staticmethod
    def _headers(job: Job) -> dict[str, str]:
        """A whole answer's headers: its id and, once a choice had a token, the time to it."""
        headers = {"x-request-id": job.shown}
        firsts = [c.first for c in job.clocks if c.first is not None]
        if firsts:
            headers[TTFT_HEADER] = f"{(min(firsts) - job.clocks[0].arrived) * 1000:.3f}"
        return headers

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def retrieve_model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the served model's card, or a 404."""
        name = request.path_params["model"]
        if name != self.model:
            return error(404, f"The model `{name}` does not exist.", code="model_not_found", param="model")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": "kvgate",
            "max_model_len": self.engine.max_model_len,
        }

    async def health(self, request: Request) -> Response:
        """200 while the engine runs and steps; 503 (OpenAI-shaped) when it has stopped, is
        stalled beyond the stall timeout, or the worker drains."""
        why = self.unavailable()
        if why is None:
            return JSONResponse({"status": "ok"})
        return error(503, why[1], "server_error", why[0], headers={"retry-after": str(RETRY_AFTER_S)})

    async def prometheus(self, request: Request) -> Response:
        body, ctype = self.metrics.render()
        return Response(body, media_type=ctype)


def shown_id(key: str, header: str | None, parsed: ParsedRequest) -> str:
    """The id a request's answer carries, in vLLM's order: the client's `x-request-id` header
    (as sent: the gateway sends its own answer id there), else its body `request_id` behind the
    kind's prefix (`cmpl-`, `chatcmpl-`, as vLLM shows it), else the engine key `key`. A header
    that breaks CLIENT_ID is not shown (a body's was refused): a client's id goes into a response
    header and log lines only as printable ASCII of bounded length."""
    if header and CLIENT_ID.fullmatch(header):
        return header
    if parsed.client_request_id is not None:
        return id_prefix(parsed.kind) + parsed.client_request_id
    return key
