"""The worker's HTTP API (starlette): OpenAI endpoints plus state, KV events and snapshots."""
import asyncio
import contextlib
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.engine import Engine, RequestOutput, call_sinks
from workers.metrics import WorkerMetrics
from workers.protocol import (ParsedRequest, chunk, error_body, full_response, new_id,
                              parse_request, usage)
from workers.sampling_params import InvalidRequest
from workers.transfer_http import TransferService


def error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
          param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code, param), status_code=status)


class WorkerServer:
    """Binds one engine to HTTP. Each request gets an asyncio queue fed from the engine thread."""

    def __init__(self, engine: Engine, served_model: str, vocab_size: int,
                 internal_token: str | None = None, kv_transport: str = "http"):
        self.engine = engine
        self.transfer = TransferService(engine, served_model, internal_token, kv_transport)
        self.model = served_model
        self.vocab_size = vocab_size
        self.metrics = WorkerMetrics(engine)
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
            Route("/kv/import", self.transfer.import_endpoint, methods=["POST"]),
            Route("/kv/reset", self.kv_reset, methods=["POST"]),
        ], lifespan=self._lifespan)

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

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _parse(self, request: Request, kind: str) -> ParsedRequest | Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the request body is not valid JSON")
        if isinstance(body, dict) and body.get("model") not in (None, self.model):
            return error(404, f"The model `{body.get('model')}` does not exist.", "invalid_request_error",
                         "model_not_found", "model")
        try:
            parsed = await asyncio.to_thread(parse_request, body, kind, self.engine.tokenizer,
                                             self.engine.executor.max_model_len, self.vocab_size)
        except InvalidRequest as e:
            return error(400, str(e), code=e.code, param=e.param)
        capacity = self.engine.pool.num_blocks * self.engine.config.block_size
        if len(parsed.prompt_ids) + 1 > capacity:
            return error(400, f"the prompt needs {len(parsed.prompt_ids)} tokens of KV cache; this "
                         f"worker holds {capacity}", code="context_length_exceeded", param="prompt")
        return parsed

    async def _generate(self, request: Request, kind: str) -> Response:
        parsed = await self._parse(request, kind)
        if isinstance(parsed, Response):
            return parsed
        rid = request.headers.get("x-request-id") or new_id(kind)
        loop = asyncio.get_running_loop()
        self._bind(loop)
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        started = time.monotonic()
        kv = parsed.kv_transfer
        export = self.transfer.exporter(kv["export_to"], loop, parsed.cache_salt) if "export_to" in kv else None
        self.engine.submit(rid, parsed.prompt_ids, parsed.params, q.put_nowait,
                           kv_wait_s=kv.get("wait_ms", 0) / 1000.0, export=export, cache_salt=parsed.cache_salt)
        if parsed.stream:
            return StreamingResponse(self._stream(rid, parsed, q, started), media_type="text/event-stream",
                                     headers={"x-request-id": rid})
        return await self._collect(request, rid, parsed, q, started)

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have the engine post each step's outputs to this loop, where the sinks (queue puts)
        must run. Done on first use, not at startup: an app mounted elsewhere or served
        without lifespan events never runs the startup hook."""
        if self._loop is not loop:
            self._loop = loop
            self.engine.deliver = lambda batch: loop.call_soon_threadsafe(call_sinks, batch)

    async def _collect(self, request: Request, rid: str, p: ParsedRequest, q: asyncio.Queue,
                       started: float) -> Response:
        """Wait for the whole output, aborting the request if the client goes away."""
        texts, ids = [], []
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while True:
                get = asyncio.ensure_future(q.get())
                done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    self.engine.abort(rid)
                    return error(499, "client disconnected", code="client_closed")
                out = get.result()
                texts.append(out.text)
                ids.extend(out.token_ids)
                self.metrics.observe(out, started)
                if out.finish_reason is not None:
                    break
        finally:
            disconnect.cancel()
        use = usage(out.num_prompt, out.num_output, out.num_cached)
        return JSONResponse(full_response(p.kind, rid, self.model, "".join(texts), out.finish_reason,
                                          use, ids if p.return_token_ids else None))

    async def _stream(self, rid: str, p: ParsedRequest, q: asyncio.Queue, started: float):
        """SSE chunks as the engine produces them; a cancelled stream aborts the request."""
        finished = False
        first = p.kind == "chat"
        try:
            if first:
                yield _sse(chunk(p.kind, rid, self.model, "", None, first=True))
            while not finished:
                out = await q.get()
                self.metrics.observe(out, started)
                finished = out.finish_reason is not None
                if out.text or finished or p.return_token_ids:
                    yield _sse(chunk(p.kind, rid, self.model, out.text, out.finish_reason,
                                     token_ids=out.token_ids if p.return_token_ids else None))
            if p.include_usage:
                body = chunk(p.kind, rid, self.model, "", None)
                body["choices"] = []
                body["usage"] = usage(out.num_prompt, out.num_output, out.num_cached)
                yield _sse(body)
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self.engine.abort(rid)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": 0, "owned_by": "kvgate",
            "max_model_len": self.engine.executor.max_model_len}]})

    async def health(self, request: Request) -> Response:
        alive = self.engine.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    async def prometheus(self, request: Request) -> Response:
        body, ctype = self.metrics.render()
        return Response(body, media_type=ctype)

    async def state(self, request: Request) -> Response:
        return JSONResponse({**self.engine.state(), "kv_transfer": self.transfer.stats()})

    async def steps(self, request: Request) -> Response:
        """The engine's step log after step `after`: [step, executor ms, prefill tokens, decode
        seqs, decode KV tokens, prefill ctx products, wall ms] each (`StepStats`)."""
        try:
            after = int(request.query_params.get("after", "0"))
        except ValueError:
            return error(400, "'after' must be an integer")
        eng = self.engine
        got = await asyncio.wrap_future(eng.call(lambda: (eng.stats.steps, eng.stats.after(after))))
        return JSONResponse({"last": got[0], "steps": got[1]})

    async def kv_events(self, request: Request) -> Response:
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
