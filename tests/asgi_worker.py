"""A worker in-process (sim executor, the SmolLM2 tokenizer) driven through its ASGI app as
uvicorn drives it: what the lifecycle tests share (tests/test_lifecycle_intake.py,
test_lifecycle_abandoned.py, test_lifecycle_failures.py), and test_request_id.py and
test_slow_reader.py too. Timing is never asserted: engine steps
are held at a gate where the order of events matters, and each wait is only a guard against a
hang."""

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest

from workers.cli import build_server, parser
from workers.server import WorkerServer

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


def error_of(status: int, body: bytes) -> dict:
    """The OpenAI error object of an answer, checked for its shape."""
    err = json.loads(body)["error"]
    assert status >= 400 and set(err) == {"message", "type", "param", "code"} and err["message"], body
    return err


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
