"""A stand-in vLLM server for fast gateway tests: vLLM's HTTP surface (/health, /metrics,
/v1/models, /kv_event_sources, /v1/completions, /tokenize, /detokenize, /v1/embeddings and the
other pooling endpoints (/v2/embed, /pooling, /classify, /score, /v1/score, /rerank, /v1/rerank,
/v2/rerank: a small answer of each one's shape), each echoing the body it got and the `x-request-id` it was sent,
the Responses API (POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel)
over an in-memory store as vLLM's with VLLM_ENABLE_RESPONSES_API_STORE=1 (a stream opens with
`response.created` and `response.in_progress`, then a text delta and `response.completed`; a
background response stays queued until cancelled; a `?stream=true` retrieve replays the events
of a response created with both background and stream, and of any other answers a 200 head,
then breaks off, as vLLM's does)) and its ZMQ KV event publisher
(PUB + replay ROUTER, vLLM's framing), steered by the test through /_control.

    python -m tests.fake_vllm --port P --events-port E --replay-port R

/_control takes {"health": 200|503, "replay": "ok"|"stuck", "restart": true, "publish": [events],
"answer": the status completions, /tokenize, /detokenize and /v1/embeddings answer with,
"answers": {path: status} for one path's own (an engine failing generations that still
tokenizes),
"responses": false (the Responses API answers 501, as vLLM's does for a model without it),
"stream_wait_s": a create stream's silence after its opening events, "stream_gap_s": after its
first output event (a queued request's wait, a stall between tokens), "replays": false (every
`?stream=true` retrieve breaks off after its head),
"embeddings": false (the pooling routes are not mounted, as on a server of a generative model:
FastAPI's bare 404), "embeddings_body": how the embeddings answer is sent: {} whole, {"pieces": n, "gap_s": s,
"dims": d} in n pieces s apart (vectors of d numbers), {"hold": true} its last piece only once
/_control gets {"release": true} (the answer's "released" says whether it did, or 30 s passed),
{"drop": true} its connection dropped after its first piece}
and answers whether a control-plane request ever carried kvgate's internal token (`saw_token`);
events are vLLM BlockStored/BlockRemoved maps; `restart` is a new process (numbering from 0, an
empty replay buffer, a new process_start_time_seconds).
"""

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from collections import deque

import msgpack
import uvicorn
import zmq
import zmq.asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "smollm2-135m"
END = b"\xff" * 8
POOLED = ("/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")


class Fake:
    def __init__(self, events_port: int, replay_port: int):
        self.events_port, self.replay_port = events_port, replay_port
        self.health, self.replay_mode = 200, "ok"
        self.answer = 200  # the status /v1/completions answers with (an error body unless 200)
        self.answers: dict[str, int] = {}  # a path's own status, in place of `answer`
        self.embeddings = True  # whether /v1/embeddings is mounted (an embedding model's server)
        self.responses = True  # whether the Responses API serves (a generative model's server)
        self.create_delay_s = 0.0  # how long a create takes to generate its answer
        self.stream_wait_s = 0.0  # a create stream's silence between its opening and its first output
        self.stream_gap_s = 0.0  # and after its first output event
        self.replays = True  # whether a `?stream=true` retrieve replays the events kept of a response
        self.events: dict[str, list[tuple[str, dict]]] = {}  # a background stream's events, by response id
        self.creates = 0  # creates received
        self.stored: dict[str, dict] = {}  # response id -> the stored response
        self.embeddings_body: dict = {}  # how its answer is sent (the docstring's embeddings_body)
        self.release = asyncio.Event()
        self.saw_token = False  # whether any request carried kvgate's internal token
        self.started = time.time()
        self.seq = 0
        self.buffer: deque = deque(maxlen=10_000)
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.router = self.ctx.socket(zmq.ROUTER)

    async def serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            if self.replay_mode == "stuck":
                continue  # never answers: the gateway must not wait on it
            for seq, payload in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", END, b""])

    async def publish(self, events: list) -> None:
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        self.buffer.append((self.seq, payload))
        await self.pub.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def metrics(self) -> str:
        return "\n".join(
            [
                f"process_start_time_seconds {self.started}",
                f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 1.0',
                f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 2.0',
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.25',
                'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="400"} 1.0',
                "",
            ]
        )


def app(fake: Fake) -> Starlette:
    async def health(request: Request) -> Response:
        fake.saw_token |= "x-kvgate-token" in request.headers
        return Response(b"", fake.health)

    async def metrics(request: Request) -> Response:
        fake.saw_token |= "x-kvgate-token" in request.headers
        return PlainTextResponse(fake.metrics())

    async def models(request: Request) -> Response:
        fake.saw_token |= "x-kvgate-token" in request.headers
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "parent": None, "max_model_len": 2048}]})

    async def sources(request: Request) -> Response:
        fake.saw_token |= "x-kvgate-token" in request.headers
        return JSONResponse(
            {
                "0": {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{fake.events_port}",
                    "replay_endpoint": f"tcp://*:{fake.replay_port}",
                    "topic": "kv",
                }
            }
        )

    async def completions(request: Request) -> Response:
        raw = await request.body()
        if (failed := failure(request)) is not None:
            return failed
        return JSONResponse(
            {
                "object": "text_completion",
                "choices": [{"index": 0, "text": "ok"}],
                "usage": {
                    "prompt_tokens": 1,
                    "completion_tokens": 1,
                    "total_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
                "received": raw.decode(),
            }
        )

    def failure(request: Request) -> Response | None:
        status = fake.answers.get(request.url.path, fake.answer)
        if status == 200:
            return None
        error = {"message": "engine failed", "type": "InternalServerError", "param": None, "code": status}
        return JSONResponse({"error": error}, status)

    def echo(request: Request, raw: bytes) -> dict:
        return {"received": raw.decode(), "request_id": request.headers.get("x-request-id")}

    async def tokenize(request: Request) -> Response:
        raw = await request.body()
        fake.saw_token |= "x-kvgate-token" in request.headers
        body = {"count": 3, "max_model_len": 2048, "tokens": [1, 2, 3], "token_strs": None}
        return failure(request) or JSONResponse({**body, **echo(request, raw)})

    async def detokenize(request: Request) -> Response:
        raw = await request.body()
        fake.saw_token |= "x-kvgate-token" in request.headers
        return failure(request) or JSONResponse({"prompt": "abc", **echo(request, raw)})

    async def embeddings(request: Request) -> Response:
        raw = await request.body()
        fake.saw_token |= "x-kvgate-token" in request.headers
        if fake.embeddings == 501:  # vLLM 0.32 serving a model without the task: the route is there
            error = {"message": "The model does not support Embeddings API", "type": "NotImplementedError"}
            return JSONResponse({"error": {**error, "param": None, "code": 501}}, 501)
        if not fake.embeddings:
            return JSONResponse({"detail": "Not Found"}, 404)
        given = json.loads(raw).get("input")
        n = len(given) if isinstance(given, list) and given and not isinstance(given[0], int) else 1
        how = fake.embeddings_body
        vector = [0.5] * how["dims"] if "dims" in how else [0.5, -0.5]
        data = [{"object": "embedding", "index": i, "embedding": vector} for i in range(n)]
        usage = {"prompt_tokens": n, "total_tokens": n}
        answer = {"object": "list", "model": MODEL, "data": data, "usage": usage}
        if (failed := failure(request)) is not None or not how:
            return failed or JSONResponse({**answer, **echo(request, raw)})
        text = json.dumps({**answer, **echo(request, raw)}).encode()
        return StreamingResponse(pieces(text, how), media_type="application/json")

    async def pooled(request: Request) -> Response:
        """The other pooling endpoints: a small answer of the path's shape, with the echo."""
        raw = await request.body()
        fake.saw_token |= "x-kvgate-token" in request.headers
        if not fake.embeddings:
            return JSONResponse({"detail": "Not Found"}, 404)
        usage = {"prompt_tokens": 3, "total_tokens": 3}
        path = request.url.path
        if "rerank" in path:
            answer: dict = {"results": [{"index": 0, "document": {"text": "d"}, "relevance_score": 0.9}]}
        elif "score" in path:
            answer = {"object": "list", "data": [{"index": 0, "object": "score", "score": 0.9}]}
        elif path == "/classify":
            answer = {"object": "list", "data": [{"index": 0, "label": "yes", "probs": [0.9, 0.1], "num_classes": 2}]}
        elif path == "/v2/embed":
            answer = {"embeddings": {"float": [[0.5, -0.5]]}, "texts": ["t"]}
        else:
            answer = {"object": "list", "data": [{"index": 0, "object": "pooling", "data": [0.5, -0.5]}]}
        return failure(request) or JSONResponse({"model": MODEL, "usage": usage, **answer, **echo(request, raw)})

    def not_found(response_id: str) -> Response:
        error = {"message": f"Response with id '{response_id}' not found.", "type": "invalid_request_error"}
        return JSONResponse({"error": {**error, "param": "response_id", "code": 404}}, 404)

    def responses_failure(request: Request) -> Response | None:
        if not fake.responses:
            error = {"message": "The model does not support Responses API", "type": "NotImplementedError"}
            return JSONResponse({"error": {**error, "param": None, "code": 501}}, 501)
        return failure(request)

    async def create_response(request: Request) -> Response:
        """vLLM's create: the previous response must be stored here; the answer (or a stream's
        `response.created`) names the new one, stored unless `store` is false."""
        raw = await request.body()
        fake.creates += 1
        if (failed := responses_failure(request)) is not None:
            return failed
        await asyncio.sleep(fake.create_delay_s)
        body = json.loads(raw)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in fake.stored:
            return not_found(previous)
        response = {
            "id": f"resp_{uuid.uuid4().hex[:16]}",
            "object": "response",
            "model": MODEL,
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
            "status": "queued" if body.get("background") else "completed",
            "previous_response_id": previous,
            **echo(request, raw),
        }
        if body.get("store", True):
            fake.stored[response["id"]] = response
        if not body.get("stream"):
            return JSONResponse(response)
        started = {"response": {**response, "status": "in_progress"}}
        delta = {"item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "ok"}
        events = [
            ("response.created", started),
            ("response.in_progress", started),
            ("response.output_text.delta", delta),
            ("response.completed", {"response": response}),
        ]
        if body.get("background"):
            fake.events[response["id"]] = events
        waits = {2: fake.stream_wait_s, 3: fake.stream_gap_s}  # before the first output, after it
        return StreamingResponse(sse(events, waits), media_type="text/event-stream")

    async def sse(events: list[tuple[str, dict]], waits: dict[int, float], first: int = 0):
        for n, (kind, data) in enumerate(events):
            if n >= first:
                await asyncio.sleep(waits.get(n, 0.0))
                yield f"event: {kind}\ndata: {json.dumps({**data, 'sequence_number': n, 'type': kind})}\n\n"

    async def unknown_events(response_id: str):
        raise ValueError(f"Unknown response_id: {response_id}")  # vLLM's: uvicorn cuts the connection
        yield ""

    async def retrieve_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if (failed := responses_failure(request)) is not None:
            return failed
        if response_id not in fake.stored:
            return not_found(response_id)
        response = {**fake.stored[response_id], "query": request.url.query}
        if request.query_params.get("stream") != "true":
            return JSONResponse(response)
        if response_id not in fake.events or not fake.replays:
            return StreamingResponse(unknown_events(response_id), media_type="text/event-stream")
        after = int(request.query_params.get("starting_after", -1))
        return StreamingResponse(sse(fake.events[response_id], {}, after + 1), media_type="text/event-stream")

    async def cancel_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if (failed := responses_failure(request)) is not None:
            return failed
        if response_id not in fake.stored:
            return not_found(response_id)
        response = fake.stored[response_id]
        if response["status"] not in ("queued", "in_progress"):
            error = {"message": "Cannot cancel a synchronous response.", "type": "invalid_request_error"}
            return JSONResponse({"error": {**error, "param": "response_id", "code": 400}}, 400)
        response["status"] = "cancelled"
        return JSONResponse(response)

    async def pieces(text: bytes, how: dict):
        if how.get("hold"):
            yield text[:-1] + b', "released": '
            try:
                await asyncio.wait_for(fake.release.wait(), 30)
                yield b'"control"}'
            except TimeoutError:
                yield b'"timeout"}'
            return
        n = how.get("pieces", 2)
        size = -(-len(text) // n)
        for i in range(n):
            if i:
                await asyncio.sleep(how.get("gap_s", 0))
            yield text[i * size : (i + 1) * size]
            if how.get("drop"):
                raise ConnectionAbortedError("the fake drops the answer")  # uvicorn cuts the connection

    async def control(request: Request) -> Response:
        body = json.loads(await request.body())
        fake.health = body.get("health", fake.health)
        fake.replay_mode = body.get("replay", fake.replay_mode)
        fake.answer = body.get("answer", fake.answer)
        fake.answers = body.get("answers", fake.answers)
        fake.embeddings = body.get("embeddings", fake.embeddings)
        fake.responses = body.get("responses", fake.responses)
        fake.create_delay_s = body.get("create_delay_s", fake.create_delay_s)
        fake.stream_wait_s = body.get("stream_wait_s", fake.stream_wait_s)
        fake.stream_gap_s = body.get("stream_gap_s", fake.stream_gap_s)
        fake.replays = body.get("replays", fake.replays)
        fake.embeddings_body = body.get("embeddings_body", fake.embeddings_body)
        if body.get("release"):
            fake.release.set()
        if body.get("restart"):
            fake.seq, fake.started = 0, time.time()
            fake.buffer.clear()
        for events in body.get("publish", []):
            await fake.publish(events)
        return JSONResponse({"seq": fake.seq, "saw_token": fake.saw_token, "creates": fake.creates})

    @contextlib.asynccontextmanager
    async def lifespan(_):
        fake.pub.bind(f"tcp://127.0.0.1:{fake.events_port}")
        fake.router.bind(f"tcp://127.0.0.1:{fake.replay_port}")
        task = asyncio.create_task(fake.serve_replay())
        yield
        task.cancel()

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/kv_event_sources", sources),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            *(Route(p, pooled, methods=["POST"]) for p in POOLED),
            Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve_response),
            Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
            Route("/_control", control, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events-port", type=int, required=True)
    p.add_argument("--replay-port", type=int, required=True)
    args = p.parse_args()
    uvicorn.run(app(Fake(args.events_port, args.replay_port)), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
