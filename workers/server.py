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
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.engine import ENGINE_ERROR, ENGINE_STOPPED, Engine, EngineStopped
from workers.http_guard import CloseOn5xx
from workers.outputs import RequestOutput, call_sinks
from workers.metrics import RequestClock, WorkerMetrics
from workers.protocol import (TTFT_HEADER, ParsedRequest, chunk, error_body, full_response, new_id,
                              parse_request, usage)
from workers.sampling_params import InvalidRequest
from workers.strict_json import loads
from workers.tracing import WorkerTracing
from workers.transfer_http import TransferService

log = logging.getLogger("kvgate.worker")
RETRY_AFTER_S = 1
SHOWN_ID = re.compile(r"[!-~]{1,128}")  # a client's x-request-id we echo: printable ASCII, no spaces
FAILURES = {  # RequestOutput.error -> (HTTP status, message)
    ENGINE_ERROR: (500, "the engine failed while running this request"),
    ENGINE_STOPPED: (503, "the engine has stopped"),
}


def error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
          param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


def failure(out: RequestOutput) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body of a request the engine failed."""
    status, message = FAILURES.get(out.error, FAILURES[ENGINE_ERROR])
    return status, error_body(message, "server_error", out.error)


@dataclass
class Job:
    """One admitted request: `key` keys it in the engine, `shown` is the id its answer carries;
    `clock` times it for the metrics, `span` traces it (None while tracing is off)."""
    key: str
    shown: str
    parsed: ParsedRequest
    outputs: asyncio.Queue
    clock: RequestClock
    span: object = None


class WorkerServer:
    """Binds one engine to HTTP. Each request gets an asyncio queue fed from the engine thread."""

    def __init__(self, engine: Engine, served_model: str, vocab_size: int,
                 internal_token: str | None = None, kv_transport: str = "http",
                 max_queued_requests: int = 1024, stall_timeout_s: float = 5.0,
                 tracing: WorkerTracing | None = None):
        self.engine = engine
        self.max_in_flight = engine.config.max_num_seqs + max_queued_requests
        self.stall_timeout_s = stall_timeout_s
        self.draining = False  # set on SIGTERM (workers/drain.py)
        self.in_flight = 0  # requests handed to the engine and not finished
        self.transfer = TransferService(engine, served_model, internal_token, kv_transport)
        self.model = served_model
        self.vocab_size = vocab_size
        self.metrics = WorkerMetrics(engine, served_model)
        self.tracing = tracing or WorkerTracing()
        self.transfer.tracing = self.tracing
        self.publisher = None  # a workers.redis_publisher.RedisPublisher when --redis is given
        self._loop: asyncio.AbstractEventLoop | None = None
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models),
            Route("/health", self.health),
            Route("/metrics", self.prometheus),
            Route("/state", self.state),
            Route("/steps", self.steps),
            Route("/kv/events", self.kv_events),
            Route("/kv/snapshot", self.kv_snapshot),
            *self.transfer.routes(),
            Route("/kv/reset", self.kv_reset, methods=["POST"]),
        ], lifespan=self._lifespan, middleware=[Middleware(CloseOn5xx)])

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        loop = asyncio.get_running_loop()
        self._kv_changed = asyncio.Event()
        self.engine.events.subscribe(lambda ev: loop.call_soon_threadsafe(self._kv_changed.set))
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
        self.metrics.rejected[why[0]].inc()
        return error(503, why[1], "server_error", why[0], headers={"retry-after": str(RETRY_AFTER_S)})

    async def _parse(self, request: Request, kind: str) -> ParsedRequest | Response:
        try:
            body = loads(await request.body())
        except InvalidRequest as e:
            return error(400, str(e), code=e.code, param=e.param)
        if isinstance(body, dict) and body.get("kv_transfer") is not None and not self.transfer.authorised(request):
            return error(403, "'kv_transfer' is internal: it needs the fleet's internal token",
                         "permission_error", "forbidden", "kv_transfer")
        if isinstance(body, dict) and body.get("model") not in (None, self.model):
            return error(404, f"The model `{body.get('model')}` does not exist.", "invalid_request_error",
                         "model_not_found", "model")
        try:
            parsed = await asyncio.to_thread(parse_request, body, kind, self.engine.tokenizer,
                                             self.engine.max_model_len, self.vocab_size)
        except InvalidRequest as e:
            return error(400, str(e), code=e.code, param=e.param)
        return parsed

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
        job = Job(key, given if given and SHOWN_ID.fullmatch(given) else key, parsed, asyncio.Queue(),
                  RequestClock(arrived))
        job.span = self.tracing.start(f"POST {request.url.path}", request.headers, parsed, key)
        refused = self._refusal() or self._submit(job)
        if refused is not None:
            self.tracing.end(job.span, refused.status_code)
            return refused
        if parsed.stream:
            return StreamingResponse(self._stream(job), media_type="text/event-stream",
                                     headers={"x-request-id": job.shown})
        return await self._collect(request, job)

    def _submit(self, job: Job) -> Response | None:
        """Hand the job to the engine; counted in flight until its last output arrives."""
        loop = asyncio.get_running_loop()
        self._bind(loop)
        p, kv = job.parsed, job.parsed.kv_transfer
        export = self.transfer.exporter(kv["export_to"], loop, p.cache_salt, job.span) if "export_to" in kv else None

        def sink(out: RequestOutput) -> None:
            job.outputs.put_nowait(out)
            if out.finish_reason is not None:
                self.in_flight -= 1

        self.in_flight += 1
        try:
            self.engine.submit(job.key, p.prompt_ids, p.params, sink, kv_wait_s=kv.get("wait_ms", 0) / 1000.0,
                               export=export, cache_salt=p.cache_salt, trace=job.span is not None)
        except EngineStopped:
            self.in_flight -= 1
            return self._refusal()
        return None

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have the engine post each step's outputs to this loop, where the sinks (queue puts)
        must run. Done on first use, not at startup: an app mounted elsewhere or served
        without lifespan events never runs the startup hook."""
        if self._loop is not loop:
            self._loop = loop
            self.engine.deliver = lambda batch: loop.call_soon_threadsafe(call_sinks, batch)

    async def _collect(self, request: Request, job: Job) -> Response:
        """Wait for the whole output, aborting the request if the client goes away."""
        texts, ids = [], []
        p, headers = job.parsed, {"x-request-id": job.shown}
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while True:
                get = asyncio.ensure_future(job.outputs.get())
                done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    self.engine.abort(job.key)
                    self.tracing.end(job.span, 499)
                    return error(499, "client disconnected", code="client_closed")
                out = get.result()
                texts.append(out.text)
                ids.extend(out.token_ids)
                self.metrics.observe(out, job.clock)
                if out.finish_reason is not None:
                    break
        finally:
            disconnect.cancel()
        self.tracing.finish(job.span, out)
        if job.clock.first is not None:
            headers[TTFT_HEADER] = f"{(job.clock.first - job.clock.arrived) * 1000:.3f}"
        if out.error is not None:
            status, body = failure(out)
            return JSONResponse(body, status, headers)
        use = usage(out.num_prompt, out.num_output, out.num_cached)
        return JSONResponse(full_response(p.kind, job.shown, self.model, "".join(texts), out.finish_reason,
                                          use, ids if p.return_token_ids else None), headers=headers)

    async def _stream(self, job: Job):
        """SSE chunks as the engine produces them; a cancelled stream aborts the request. A
        request that fails ends with an OpenAI error event, then [DONE]."""
        finished = False
        p, rid = job.parsed, job.shown
        try:
            if p.kind == "chat":
                yield _sse(chunk(p.kind, rid, self.model, "", None, first=True))
            while not finished:
                out = await job.outputs.get()
                self.metrics.observe(out, job.clock)
                finished = out.finish_reason is not None
                if finished:
                    self.tracing.finish(job.span, out)
                if out.error is not None:
                    yield _sse(failure(out)[1])
                elif out.text or finished or p.return_token_ids:
                    yield _sse(chunk(p.kind, rid, self.model, out.text, out.finish_reason,
                                     token_ids=out.token_ids if p.return_token_ids else None))
            if p.include_usage and out.error is None:
                body = chunk(p.kind, rid, self.model, "", None)
                body["choices"] = []
                body["usage"] = usage(out.num_prompt, out.num_output, out.num_cached)
                yield _sse(body)
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self.engine.abort(job.key)
                self.tracing.end(job.span, 499)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": 0, "owned_by": "kvgate",
            "max_model_len": self.engine.max_model_len}]})

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

    def _refused(self, request: Request) -> Response | None:
        """403 for an internal read without the token, when this worker has one (the gateway
        and tools send it; workers/internal_auth.py says why)."""
        if self.transfer.token and not self.transfer.authorised(request):
            return error(403, f"{request.url.path} is internal: it needs the fleet's internal token",
                         "permission_error", "forbidden")
        return None

    async def state(self, request: Request) -> Response:
        """Load as of the last step, plus liveness now: whether the engine thread runs, how long
        it has gone without completing a step while it has work, and whether the worker drains."""
        if refused := self._refused(request):
            return refused
        return JSONResponse({**self.engine.state(), "kv_transfer": self.transfer.stats(),
                             "engine_alive": self.engine.alive, "engine_stall_s": self.engine.stall_s(),
                             "draining": self.draining, "in_flight": self.in_flight})

    async def steps(self, request: Request) -> Response:
        """The engine's step log after step `after`: each step's number, times and work
        (`StepRecord.to_json`)."""
        if refused := self._refused(request):
            return refused
        try:
            after = int(request.query_params.get("after", "0"))
        except ValueError:
            return error(400, "'after' must be an integer")
        eng = self.engine
        got = await asyncio.wrap_future(eng.call(lambda: (eng.stats.steps, eng.stats.after(after))))
        return JSONResponse({"last": got[0], "steps": got[1]})

    async def kv_events(self, request: Request) -> Response:
        if refused := self._refused(request):
            return refused
        try:
            after = int(request.query_params.get("after", "0"))
            timeout = min(float(request.query_params.get("timeout", "0")), 30.0)
        except ValueError:
            return error(400, "'after' must be an integer and 'timeout' a number of seconds")
        events = self.engine.events
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while events.last_seq <= after and loop.time() < deadline:
            self._kv_changed.clear()
            if events.last_seq > after:
                break
            try:
                await asyncio.wait_for(self._kv_changed.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
        return JSONResponse(events.after(after).to_json())

    async def kv_reset(self, request: Request) -> Response:
        """Drop every cached-but-free block (after a weight reload); internal, token-protected."""
        if not self.transfer.authorised(request):
            return error(403, "resetting the prefix cache needs the fleet's internal token",
                         "permission_error", "forbidden")
        evicted = await asyncio.wrap_future(self.engine.call(self.engine.pool.clear_cache))
        return JSONResponse({"evicted": evicted})

    async def kv_snapshot(self, request: Request) -> Response:
        if refused := self._refused(request):
            return refused
        eng = self.engine
        snap = await asyncio.wrap_future(eng.call(lambda: {
            "worker_id": eng.config.worker_id, "seq": eng.events.last_seq,
            "block_size": eng.config.block_size, "hashes": eng.pool.resident_hashes()}))
        return JSONResponse(snap)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
