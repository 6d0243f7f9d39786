"""A worker's requests from admission to their last output, in-process (sim executor, the
SmolLM2 tokenizer), driven through its ASGI app as uvicorn drives it.

The rule: a request that ends early (its client left, a choice failed, the engine stops) leaves
nothing running for no one and nothing counted in flight, and its client (if still there) gets
an OpenAI-shaped error. Timing is never asserted: engine steps are held at a gate where the
order of events matters, and each wait is only a guard against a hang.
"""

import asyncio
import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from workers import engine as engine_module
from workers import job_runner
from workers.cli import build_server, parser
from workers.http_guard import DEFAULT_MAX_BODY_BYTES
from workers.server import WorkerServer
from workers.tracing import WorkerTracing

MODEL = "smollm2-135m"
TOKEN = "lifecycle-token"
GUARD_S = 30.0  # a hang guard, never a timing assert


WORKER = (
    "--executor",
    "sim",
    "--model",
    MODEL,
    "--internal-token",
    TOKEN,
    "--num-blocks",
    "64",
    "--max-model-len",
    "512",
)


@pytest.fixture
def server():
    s = build_server(parser().parse_args(WORKER))
    try:
        yield s
    finally:
        s.engine.stop()


@pytest.fixture
def gate(server):
    """Every engine step waits until the gate opens: what the test does meanwhile happens before
    the step's tokens reach anyone."""
    opened = threading.Event()
    server.engine.executor.wait = lambda s: opened.wait(GUARD_S)
    try:
        yield opened
    finally:
        opened.set()


def scope_of(path: str, headers: dict[str, str]) -> dict:
    """An HTTP/1.1 POST's ASGI scope as uvicorn makes it."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("w", 80),
    }


class Call:
    """One request to the app as uvicorn makes it: a JSON body (with its Content-Length) or
    chunks of one (chunked), then `http.disconnect` once the client leaves (`leave`); what the
    app sends is kept in `sent`, and `pulled` counts the body bytes it has read. A client that
    `reads` nothing holds each part of the response body in its send until it leaves, as
    uvicorn's send waits on a paused transport."""

    def __init__(self, app, path: str, body: dict | Iterator[bytes], headers: dict | None = None, reads: bool = True):
        if isinstance(body, dict):
            raw = json.dumps(body).encode()
            self._parts, heads = iter([raw]), {"content-length": str(len(raw))}
        else:
            self._parts, heads = body, {"transfer-encoding": "chunked"}
        heads = {"content-type": "application/json", **heads, **(headers or {})}
        self.gone = asyncio.Event()
        self.sent: asyncio.Queue = asyncio.Queue()
        self.pulled = 0
        self._read = False
        self.reads = reads
        self.task = asyncio.ensure_future(app(scope_of(path, heads), self._receive, self._send))

    async def _receive(self) -> dict:
        if not self._read:
            part = next(self._parts, None)
            if part is not None:
                self.pulled += len(part)
                return {"type": "http.request", "body": part, "more_body": True}
            self._read = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, msg: dict) -> None:
        await self.sent.put(msg)
        if msg["type"] == "http.response.body" and not self.reads:
            await self.gone.wait()

    def leave(self) -> None:
        self.gone.set()

    async def first_body(self) -> bytes:
        """The first non-empty part of the response body (the client has read it)."""
        while True:
            msg = await asyncio.wait_for(self.sent.get(), GUARD_S)
            if msg["type"] == "http.response.body" and msg.get("body"):
                return msg["body"]

    async def response(self) -> tuple[int, dict, bytes]:
        """(status, headers, whole body) once the app has answered."""
        try:
            await asyncio.wait_for(self.task, GUARD_S)
        except TimeoutError:
            pytest.fail(f"no answer in {GUARD_S} s: the request hangs")
        status, headers, parts = 0, {}, []
        while not self.sent.empty():
            msg = self.sent.get_nowait()
            if msg["type"] == "http.response.start":
                status, headers = msg["status"], {k.decode(): v.decode() for k, v in msg["headers"]}
            else:
                parts.append(msg.get("body", b""))
        return status, headers, b"".join(parts)


async def until(check, what: str) -> None:
    """Yield to the loop until `check()` holds (a hang guard of GUARD_S, not a timing assert)."""

    async def poll():
        while not check():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), GUARD_S)
    except TimeoutError:
        pytest.fail(f"never: {what}")


async def settled(server: WorkerServer) -> None:
    """Until nothing is counted in flight and the engine has no work left."""
    await until(lambda: server.in_flight == 0 and not server.engine.has_work(), "the worker is idle")


def client(server: WorkerServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://w", timeout=GUARD_S)


def error_of(status: int, body: bytes) -> dict:
    """The OpenAI error object of an answer, checked for its shape."""
    err = json.loads(body)["error"]
    assert status >= 400 and set(err) == {"message", "type", "param", "code"} and err["message"], body
    return err


def stream_error(status: int, body: bytes) -> dict:
    """The error event a failed stream ends with (before [DONE])."""
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    assert status == 200 and body.endswith(b"data: [DONE]\n\n"), body
    return events[-1]["error"]


def n_choices(stream: bool) -> dict:
    """Four choices of 20 tokens each for one chat prompt."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "n": 4,
        "max_tokens": 20,
        "stream": stream,
        "ignore_eos": True,
    }


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("how", ["disconnect", "cancel"])
def test_a_client_gone_before_the_first_token_starts_no_other_choice(server, gate, stream, how):
    """n=4, the client gone while choice 0's prefill runs: choice 0 is aborted and choices 1-3,
    which would start on its first token, never start (they would run 20 tokens for no one)."""

    async def go():
        call = Call(server.app, "/v1/chat/completions", n_choices(stream))
        await until(lambda: server.engine.has_work(), "choice 0 is in the engine")
        if stream:
            await call.first_body()  # the role chunks: the stream is under way
        if how == "disconnect":
            call.leave()
            await call.response()
        else:
            call.task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call.task
        gate.set()
        await settled(server)

    asyncio.run(go())
    assert server.engine.stats.generated_tokens <= 1  # choice 0's prefill token at most


@pytest.mark.parametrize("stream", [True, False])
def test_a_choice_aborted_once_no_one_reads_is_counted_aborted(server, gate, stream):
    """n=4, the client gone while choice 0 prefills: each choice counts once in
    kvgate_worker_requests_finished_total as aborted, choice 0 (the one the engine took) and
    choices 1-3 (never started), as a failure of choice 0 counts each failed. Outputs were
    counted as they were read, and no one reads an abandoned request's, so an abort was never
    counted; then choice 0's abort alone. Only choice 0 adds histogram samples."""

    async def go():
        call = Call(server.app, "/v1/chat/completions", n_choices(stream))
        await until(lambda: server.engine.has_work(), "choice 0 is in the engine")
        if stream:
            await call.first_body()
        call.leave()
        await call.response()
        gate.set()
        await settled(server)

    asyncio.run(go())
    assert finished(server) == {"stop": 0, "length": 0, "abort": 4, "error": 0}
    assert samples(server) == ONE_EACH and observed(server, "time_to_first_token_seconds") <= 1


def finished(server: WorkerServer) -> dict[str, float]:
    """kvgate_worker_requests_finished_total by finish reason."""
    return {reason: counter._value.get() for reason, counter in server.metrics.finished.items()}


# The histograms observed once per engine request as it ends.
PER_REQUEST = ("request_prompt_tokens", "request_generation_tokens", "e2e_request_latency_seconds")
ONE_EACH = dict.fromkeys(PER_REQUEST, 1.0)


def observed(server: WorkerServer, histogram: str) -> float:
    """Observations of histogram kvgate_worker_`histogram`."""
    (count,) = [
        s.value
        for m in server.metrics.registry.collect()
        for s in m.samples
        if s.name == f"kvgate_worker_{histogram}_count"
    ]
    return count


def samples(server: WorkerServer) -> dict[str, float]:
    return {h: observed(server, h) for h in PER_REQUEST}


def test_a_client_that_reads_nothing_then_leaves_leaves_nothing_running(server, gate):
    """A streaming client reads nothing (the worker's send waits, as on a paused transport),
    then leaves: the cancellation lands in that send, outside the stream, whose own cleanup
    then never runs. Choice 0 is aborted all the same and choices 1-3 never start, where all
    four once ran their 20 tokens for no one."""

    async def go():
        call = Call(server.app, "/v1/chat/completions", n_choices(True), reads=False)
        await call.first_body()  # choice 0's role chunk, which the client does not read
        call.leave()
        await call.response()
        gate.set()
        await settled(server)

    asyncio.run(go())
    assert server.engine.stats.generated_tokens <= 1  # choice 0's prefill token at most


@pytest.mark.parametrize("stream", [True, False])
def test_a_failed_first_choice_fails_the_others_without_running_them(server, stream):
    """The step running choice 0's prefill raises: the client gets the engine error, and choices
    1-3 (not started yet) fail with it instead of running 20 tokens each first."""
    executor, calls = server.engine.executor, []
    run = executor.execute

    def fails_once(chunks):
        calls.append(len(chunks))
        if len(calls) == 1:
            raise RuntimeError("a device fault")
        return run(chunks)

    executor.execute = fails_once

    async def go():
        call = Call(server.app, "/v1/chat/completions", n_choices(stream))
        status, _, body = await call.response()
        await settled(server)
        return status, body

    status, body = asyncio.run(go())
    err = stream_error(status, body) if stream else error_of(status, body)
    assert err["code"] == "engine_error" and (stream or status == 500)
    assert server.engine.stats.generated_tokens == 0 and calls == [1]
    # Each choice counted failed once; choices 1-3, never started, once added prompt_tokens=0.
    assert finished(server) == {"stop": 0, "length": 0, "abort": 0, "error": 4}
    assert samples(server) == ONE_EACH and observed(server, "time_to_first_token_seconds") == 0


LONG = 200  # tokens a choice would still run: far more than the few steps a failure takes to end them


@pytest.fixture
def lockstep(server, monkeypatch) -> dict[str, str]:
    """Each engine step after the first waits until the server's loop has taken the outputs of
    the step before (their sinks ran), as behind a slow device: the loop keeps up with every
    step, whatever else the machine runs. Returns each engine request's finish reason, recorded
    as its last output is taken."""
    taken, last, steps = threading.Semaphore(0), dict[str, str](), list[int]()
    real = job_runner.call_sinks

    def take(batch):
        real(batch)
        last.update((out.request_id, out.finish_reason) for _, out in batch if out.finish_reason is not None)
        taken.release()

    def wait(_: float) -> None:
        if steps:
            taken.acquire(timeout=GUARD_S)
        steps.append(1)

    monkeypatch.setattr(job_runner, "call_sinks", take)
    server.engine.executor.wait = wait
    return last


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    "body, failing",
    [
        ({"prompt": "hi", "n": 4}, 2),  # a sibling, handed over after choice 0's first token
        ({"prompt": ["hi", "there"], "n": 2}, 1),  # prompt 1's first choice, before its sibling
    ],
    ids=["sibling", "first-of-a-prompt"],
)
def test_a_failed_choice_fails_the_request_at_once_and_aborts_the_others(
    server, lockstep, monkeypatch, stream, body, failing
):
    """The engine fails one choice (its set-up raises: `engine_error`) while the others have
    LONG tokens left: the client gets the error without the others running on, and each of them
    is aborted (or never started): none runs to its end for no one. The request's span ends
    once, failed."""
    made, real = [], engine_module.Detokenizer

    def detokenizer(*args, **kw):
        made.append(1)
        if len(made) == failing + 1:
            raise RuntimeError("a request the engine cannot set up")
        return real(*args, **kw)

    monkeypatch.setattr(engine_module, "Detokenizer", detokenizer)
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    server.tracing = server.runner.tracing = WorkerTracing(provider)
    request = {"model": MODEL, **body, "max_tokens": LONG, "ignore_eos": True, "stream": stream}

    async def go():
        answer = await Call(server.app, "/v1/completions", request).response()
        await settled(server)
        return answer

    status, _, answer = asyncio.run(go())
    err = stream_error(status, answer) if stream else error_of(status, answer)
    assert err["code"] == "engine_error" and (stream or status == 500)
    reasons = list(lockstep.values())
    assert reasons.count("error") == 1 and set(reasons) <= {"error", "abort"}, lockstep
    # Each choice counted once, a choice never started as its prompt's first (failed, aborted),
    # and in the histograms only those the engine took.
    assert sum(finished(server).values()) == 4 and observed(server, "request_prompt_tokens") == len(lockstep)
    assert server.engine.stats.finished == 0 and server.engine.stats.generated_tokens < LONG
    (span,) = [s for s in spans.get_finished_spans() if s.name == "POST /v1/completions"]
    assert not span.status.is_ok


def test_a_requests_choices_count_in_flight_from_admission(gate):
    """A worker holding 4 requests at most (2 running + 2 queued) admits one asking for 16
    choices; while its choice 0 prefills, its 15 other choices (not in the engine yet) count
    too, so the next request is refused 503 overloaded. They once counted only once started,
    and every request admitted meanwhile would add its own 16 past the bound."""
    s = build_server(parser().parse_args([*WORKER, "--max-num-seqs", "2", "--max-queued-requests", "2"]))
    opened = threading.Event()
    s.engine.executor.wait = lambda _: opened.wait(GUARD_S)
    many = {"model": MODEL, "prompt": "hi", "n": 16, "max_tokens": 2}

    async def go():
        first = Call(s.app, "/v1/completions", many)
        await until(lambda: s.engine.has_work(), "choice 0 is in the engine")
        second = Call(s.app, "/v1/completions", {**many, "n": 1})
        await until(lambda: second.task.done() or s.in_flight == 2, "the second request is answered or admitted")
        opened.set()
        status, _, body = await second.response()
        answer = await first.response()
        await settled(s)
        return status, body, answer

    try:
        status, body, (first_status, _, first_body) = asyncio.run(go())
    finally:
        opened.set()
        s.engine.stop()
    assert status == 503 and error_of(status, body)["code"] == "overloaded"
    assert first_status == 200 and len(json.loads(first_body)["choices"]) == 16


def test_a_null_kv_wait_is_no_wait_and_leaks_nothing(server):
    """`kv_transfer.wait_ms: null` (with the internal token) is a request without a KV wait; it
    once raised after being counted in flight, and every such request stayed counted forever."""
    internal = {"x-kvgate-token": TOKEN}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "kv_transfer": {"wait_ms": None}}

    async def go():
        async with client(server) as c:
            answers = [await c.post("/v1/completions", json=body, headers=internal) for _ in range(3)]
            state = (await c.get("/state", headers=internal)).json()
            after = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        return answers, state, after

    answers, state, after = asyncio.run(go())
    assert state["in_flight"] == 0
    assert [r.status_code for r in answers] == [200] * 3, answers[0].text
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_body_said_to_be_past_the_cap_is_refused_unread(server, path):
    """Content-Length past the cap: a 413 before one byte of the body is read."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}

    async def go():
        call = Call(server.app, path, body, headers={"content-length": str(25 * DEFAULT_MAX_BODY_BYTES)})
        return *await call.response(), call.pulled

    status, _, answer, pulled = asyncio.run(go())
    assert status == 413 and error_of(status, answer)["code"] == "request_too_large"
    assert pulled == 0


def test_the_fleets_own_call_may_be_larger_than_a_clients(server):
    """A gateway's body is a client's (capped by the gateway) plus its token ids: with the
    internal token a body past the client cap is read (here its prompt then runs past the
    context: a 400), without it the same body is a 413."""
    body = {"model": MODEL, "prompt": "a " * (3 * DEFAULT_MAX_BODY_BYTES // 4), "max_tokens": 2}

    async def go(headers: dict) -> tuple[int, bytes]:
        status, _, answer = await Call(server.app, "/v1/completions", body, headers=headers).response()
        return status, answer

    fleet, client = asyncio.run(go({"x-kvgate-token": TOKEN})), asyncio.run(go({}))
    assert fleet[0] == 400 and error_of(*fleet)["code"] == "context_length_exceeded"
    assert client[0] == 413 and error_of(*client)["code"] == "request_too_large"


def test_a_chunked_body_is_refused_once_past_the_cap(server):
    """A chunked body is read only until it passes the cap, then answered 413 (the client here
    would send three times the cap)."""
    part = 2**20

    def chunks() -> Iterator[bytes]:
        yield json.dumps({"model": MODEL, "prompt": "a"})[:-2].encode()
        for _ in range(3 * DEFAULT_MAX_BODY_BYTES // part):
            yield b"a" * part

    async def go():
        call = Call(server.app, "/v1/completions", chunks())
        return *await call.response(), call.pulled

    status, _, answer, pulled = asyncio.run(go())
    assert status == 413 and error_of(status, answer)["code"] == "request_too_large"
    assert pulled <= DEFAULT_MAX_BODY_BYTES + part


def test_detokenize_takes_at_most_max_model_len_tokens(server):
    limit = server.engine.max_model_len

    async def go():
        async with client(server) as c:
            return [await c.post("/detokenize", json={"tokens": [5] * n}) for n in (limit, limit + 1, 10**6)]

    fits, over, far_over = asyncio.run(go())
    assert fits.status_code == 200 and fits.json()["prompt"]
    for r in (over, far_over):
        assert r.status_code == 400 and error_of(r.status_code, r.content)["param"] == "tokens"


@pytest.mark.parametrize("stream", [True, False])
def test_a_stopping_engine_is_a_503_not_a_hang(server, stream):
    """The engine refuses new requests while its thread still runs (stopping: `_dead` set in
    `Engine._close`): the request is answered 503 engine_stopped at once, counted nowhere."""
    server.engine._dead = True
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": stream}

    async def go():
        return await Call(server.app, "/v1/completions", body).response()

    status, headers, answer = asyncio.run(go())
    assert status == 503 and error_of(status, answer)["code"] == "engine_stopped"
    assert headers["retry-after"] and server.in_flight == 0


@pytest.mark.parametrize("stream", [True, False])
def test_an_engine_stopping_between_prompts_fails_every_choice_left(server, stream):
    """Two prompts, n=2: the engine takes prompt 0's first choice, then stops taking requests.
    Prompt 1's first choice fails, and its second (which would follow it) fails with it, as
    does prompt 0's second: the request ends with engine_stopped instead of waiting forever."""
    engine, take = server.engine, server.engine.submit

    def take_one(*args, **kw):
        take(*args, **kw)
        engine._dead = True

    engine.submit = take_one
    body = {"model": MODEL, "prompt": ["hi", "there"], "n": 2, "max_tokens": 3, "stream": stream}

    async def go():
        answer = await Call(server.app, "/v1/completions", body).response()
        await settled(server)
        return answer

    status, _, answer = asyncio.run(go())
    err = stream_error(status, answer) if stream else error_of(status, answer)
    assert err["code"] == "engine_stopped" and (stream or status == 503)
    # Choices 2-3 refused count failed, choice 1 failed or aborted, and only choice 0 has samples.
    assert sum(finished(server).values()) == 4 and finished(server)["error"] >= 2
    assert samples(server) == ONE_EACH


def test_a_client_gone_mid_body_is_a_499_not_an_internal_error(server, caplog):
    """A client that leaves while sending its body (or is cut by the body timeout) is no fault
    of the worker's: a 499 for the log, no error logged, no 500."""
    parts = [{"type": "http.request", "body": b'{"model": "', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        sent.append(msg)

    scope = scope_of("/v1/completions", {"content-type": "application/json", "transfer-encoding": "chunked"})
    with caplog.at_level("ERROR"):
        asyncio.run(asyncio.wait_for(server.app(scope, receive, send), GUARD_S))
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
