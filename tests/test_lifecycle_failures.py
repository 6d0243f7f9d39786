"""A worker's request that the engine fails: a choice's step or set-up raises, or the engine
stops (before the request, or between its prompts); the choices left fail or are aborted
instead of running on, each counted once.

The rule: a request that ends early (its client left, a choice failed, the engine stops) leaves
nothing running for no one and nothing counted in flight, and its client (if still there) gets
an OpenAI-shaped error. The worker, driven in-process through its ASGI app: tests/asgi_worker.py.
"""

import asyncio
import json
import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.asgi_worker import (
    GUARD_S,
    MODEL,
    ONE_EACH,
    Call,
    error_of,
    finished,
    n_choices,
    observed,
    samples,
    server,  # noqa: F401 (a fixture)
    settled,
)
from workers import engine as engine_module
from workers import job_runner
from workers.tracing import WorkerTracing


def stream_error(status: int, body: bytes) -> dict:
    """The error event a failed stream ends with (before [DONE])."""
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    assert status == 200 and body.endswith(b"data: [DONE]\n\n"), body
    return events[-1]["error"]


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
