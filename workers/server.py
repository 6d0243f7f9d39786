"""The worker's HTTP API (starlette): OpenAI endpoints plus state, KV events and snapshots.

Every request is keyed in the engine by an id this server makes; a client's `x-request-id` is
only echoed (response header and body `id`) and logged. A body's `kv_transfer` is read only
with the fleet's internal token. New requests are refused with 503 + Retry-After while the
engine is stopped, the worker drains, or it already holds `max_num_seqs + max_queued_requests`.
"""

import asyncio
import contextlib
import json
import logging
import re
import time
from dataclasses import replace

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.engine import ENGINE_ERROR, ENGINE_STOPPED, Engine, EngineStopped
from workers.control_routes import ControlRoutes
from workers.job import Choices, Job
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
from workers.outputs import RequestOutput, call_sinks, unstarted_failure
from workers.metrics import RequestClock, WorkerMetrics
from workers.prefix_tokens import PrefixTokenizer
from workers.protocol import TTFT_HEADER, ParsedRequest, error_body, parse_request, tokenize_body
from workers.responses import choice, chunk, full_response, new_id
from workers.sampling_params import InvalidRequest
from workers.strict_json import loads
from workers.tracing import WorkerTracing
from workers.transfer_http import TransferService
from workers.transfer_metrics import TransferCollector

log = logging.getLogger("kvgate.worker")
# a gateway's body: the client's (up to the gateway's cap) and the prompts' ids, a few bytes each
FLEET_BODY_FACTOR = 16
RETRY_AFTER_S = 1
SHOWN_ID = re.compile(r"[!-~]{1,128}")  # a client's x-request-id we echo: printable ASCII, no spaces
FAILURES = {  # RequestOutput.error -> (HTTP status, message)
    ENGINE_ERROR: (500, "the engine failed while running this request"),
    ENGINE_STOPPED: (503, "the engine has stopped"),
}


def failure(out: RequestOutput) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body of a request the engine failed."""
    status, message = FAILURES.get(out.error, FAILURES[ENGINE_ERROR])
    return status, error_body(message, "server_error", out.error)


def ended_as(first: RequestOutput, rid: str) -> RequestOutput:
    """The one output of a choice never started because its prompt's first choice ended so."""
    return RequestOutput(rid, [], "", 0, 0, 0, first.finish_reason, first.error)


class WorkerServer:
    """Binds one engine to HTTP. Each request gets an asyncio queue fed from the engine thread."""

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
        self.max_in_flight = engine.config.max_num_seqs + max_queued_requests
        self.stall_timeout_s = stall_timeout_s
        self.draining = False  # set on SIGTERM (workers/drain.py)
        self.in_flight = 0  # requests handed to the engine and not finished
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
        self._loop: asyncio.AbstractEventLoop | None = None
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
            if given is None:  # tokenizing: off the event loop
                parsed = await asyncio.to_thread(parse_request, body, kind, tok, max_len, self.vocab_size)
            else:  # nothing to tokenize: a thread hop would cost more than the checks
                parsed = parse_request(body, kind, tok, max_len, self.vocab_size, given)
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
        -> token ids, read with the options the completion and chat endpoints take
        (`add_special_tokens`, `add_generation_prompt`, `continue_final_message`,
        `chat_template_kwargs`), with their strings when `return_token_strs`. `model` is optional
        here, as in vLLM."""
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
            log.info("request %s has x-request-id %r", key, given[:128])
        job = Job(
            key,
            given if given and SHOWN_ID.fullmatch(given) else key,
            parsed,
            asyncio.Queue(),
            [RequestClock(arrived) for _ in range(parsed.num_choices)],
        )
        job.span = self.tracing.start(f"POST {request.url.path}", request.headers, parsed, key)
        refused = self._refusal() or self._submit(job)
        if refused is not None:
            self.tracing.end(job.span, refused.status_code)
            return refused
        if parsed.stream:
            return StreamingResponse(
                self._stream(job), media_type="text/event-stream", headers={"x-request-id": job.shown}
            )
        return await self._collect(request, job)

    def _submit(self, job: Job) -> Response | None:
        """Hand each prompt's first choice to the engine; a 503 if it refuses the first (it is
        stopping: its thread may still run, so `_refusal` may not know yet). The other choices
        of a prompt follow when its first one has a token: its prompt blocks are then cached, so
        they share them instead of computing the prompt again."""
        self._bind(asyncio.get_running_loop())
        try:
            self._submit_choice(job, 0)
        except EngineStopped:
            return self._refuse(ENGINE_STOPPED, "the engine has stopped")
        for i in range(job.parsed.n, job.parsed.num_choices, job.parsed.n):
            self._submit_or_fail(job, i)
        return None

    def _submit_or_fail(self, job: Job, i: int) -> None:
        """Hand choice `i` to the engine, or fail it if the engine refuses; a prompt's first
        choice fails with the choices that would follow it: each choice needs a last output, or
        the request never ends."""
        try:
            self._submit_choice(job, i)
        except EngineStopped:
            n = job.parsed.n
            for k in range(i, i + n if i % n == 0 else i + 1):
                job.outputs.put_nowait((k, unstarted_failure(job.engine_key(k), [], ENGINE_STOPPED)))

    def _submit_choice(self, job: Job, i: int) -> None:
        """Hand choice `i` to the engine; counted in flight from its handing over until its last
        output arrives, so a handing over that raises counts nothing. A prompt's j-th choice
        samples with seed + j (vLLM's rule), so seeded choices differ."""
        p, kv = job.parsed, job.parsed.kv_transfer
        j = i % p.n
        params = p.params
        if j and params.seed is not None:
            params = replace(params, seed=(params.seed + j + 2**63) % 2**64 - 2**63)
        loop = asyncio.get_running_loop()
        export = self.transfer.exporter(kv["export_to"], loop, p.cache_salt, job.span) if "export_to" in kv else None
        kv_wait_s = (kv.get("wait_ms") or 0) / 1000.0  # a null wait_ms is no wait, as protocol reads it
        siblings = list(range(i + 1, i + p.n)) if j == 0 else []

        def sink(out: RequestOutput) -> None:
            job.outputs.put_nowait((i, out))
            if siblings:
                self._follow(job, out, siblings)
                siblings.clear()
            if out.finish_reason is not None:
                self.in_flight -= 1

        self.in_flight += 1
        try:
            self.engine.submit(
                job.engine_key(i),
                p.prompts[i // p.n],
                params,
                sink,
                kv_wait_s=kv_wait_s,
                export=export,
                cache_salt=p.cache_salt,
                trace=job.span is not None and i == 0,
            )
        except BaseException:
            self.in_flight -= 1
            raise

    def _follow(self, job: Job, first: RequestOutput, siblings: list[int]) -> None:
        """Start a prompt's other choices on its first choice's first output, unless no one
        reads the answer any more or that output ended the first choice (aborted, failed): they
        would run to their last token for no one. Then each ends as the first did."""
        if job.cancelled:
            return
        if first.finish_reason in ("abort", "error"):
            for s in siblings:
                job.outputs.put_nowait((s, ended_as(first, job.engine_key(s))))
            return
        for s in siblings:
            self._submit_or_fail(job, s)

    def _abort(self, job: Job, done: list[int]) -> None:
        """No one reads the answer any more: abort its choices not `done`, and keep those not
        started from starting (`_follow`)."""
        job.cancelled = True
        for i in range(job.parsed.num_choices):
            if i not in done:
                self.engine.abort(job.engine_key(i))

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have the engine post each step's outputs to this loop, where the sinks (queue puts)
        must run. Done on first use, not at startup: an app mounted elsewhere or served
        without lifespan events never runs the startup hook."""
        if self._loop is not loop:
            self._loop = loop
            self.engine.deliver = lambda batch: loop.call_soon_threadsafe(call_sinks, batch)

    def _decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    async def _collect(self, request: Request, job: Job) -> Response:
        """Wait for every choice's whole output, aborting them if the client goes away or this
        task is cancelled."""
        p, headers = job.parsed, {"x-request-id": job.shown}
        state = Choices(p, self._decode_token)
        texts = {i: [state.echo(i)] for i in range(p.num_choices)}
        ids: dict[int, list[int]] = {i: [] for i in range(p.num_choices)}
        entries: dict[int, list] = {i: [] for i in range(p.num_choices)}
        disconnect = asyncio.ensure_future(wait_disconnect(request))
        try:
            while not state.done:
                get = asyncio.ensure_future(job.outputs.get())
                done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    self.tracing.end(job.span, 499)
                    return error(499, "client disconnected", code="client_closed")
                i, out = get.result()
                state.add(i, out)
                texts[i].append(out.text)
                ids[i].extend(out.token_ids)
                entries[i].extend(out.logprobs or ())
                self.metrics.observe(out, job.clocks[i])
        finally:
            disconnect.cancel()
            if not state.done:  # the client left, or this task was cancelled
                self._abort(job, state.finished)
        self.tracing.finish(job.span, state.last[0])
        firsts = [c.first for c in job.clocks if c.first is not None]
        if firsts:
            headers[TTFT_HEADER] = f"{(min(firsts) - job.clocks[0].arrived) * 1000:.3f}"
        failed = [out for out in state.last.values() if out.error is not None]
        if failed:
            status, body = failure(failed[0])
            return JSONResponse(body, status, headers)
        choices = [
            choice(
                p.kind,
                i,
                "".join(texts[i]),
                state.last[i].finish_reason,
                state.logprobs(i, entries[i]),
                ids[i] if p.return_token_ids else None,
            )
            for i in range(p.num_choices)
        ]
        return JSONResponse(full_response(p.kind, job.shown, self.model, choices, state.usage()), headers=headers)

    async def _stream(self, job: Job):
        """SSE chunks as the engine produces them, each naming its choice; a cancelled stream
        aborts the request. A request that fails ends with an OpenAI error event, then [DONE]."""
        p, rid = job.parsed, job.shown
        state = Choices(p, self._decode_token)
        failed = False
        try:
            if p.kind == "chat":
                for i in range(p.num_choices):
                    yield _sse(chunk(p.kind, rid, self.model, "", None, first=True, index=i))
            while not state.done:
                i, out = await job.outputs.get()
                text = out.text if i in state.last else state.echo(i) + out.text
                state.add(i, out)
                self.metrics.observe(out, job.clocks[i])
                if i == 0 and out.finish_reason is not None:
                    self.tracing.finish(job.span, out)
                if out.error is not None:
                    failed = True
                    yield _sse(failure(out)[1])
                    break
                if text or out.finish_reason or p.return_token_ids or out.logprobs:
                    yield _sse(
                        chunk(
                            p.kind,
                            rid,
                            self.model,
                            text,
                            out.finish_reason,
                            index=i,
                            token_ids=out.token_ids if p.return_token_ids else None,
                            logprobs=state.logprobs(i, out.logprobs),
                        )
                    )
            if p.include_usage and not failed:
                body = chunk(p.kind, rid, self.model, "", None)
                body["choices"] = []
                body["usage"] = state.usage()
                yield _sse(body)
            yield b"data: [DONE]\n\n"
        finally:
            if not state.done:
                self._abort(job, state.finished)
                if not failed:
                    self.tracing.end(job.span, 499)

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


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
