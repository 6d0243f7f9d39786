"""A worker's request whose client leaves while it runs: before its first token (gone or
cancelled), or after reading nothing of a stream; its choices aborted or never started, each
counted once.

The rule: a request that ends early (its client left, a choice failed, the engine stops) leaves
nothing running for no one and nothing counted in flight, and its client (if still there) gets
an OpenAI-shaped error. The worker, driven in-process through its ASGI app: tests/asgi_worker.py.
"""

import asyncio

import pytest

from tests.asgi_worker import (
    ONE_EACH,
    Call,
    finished,
    gate,  # noqa: F401 (a fixture)
    n_choices,
    observed,
    samples,
    server,  # noqa: F401 (a fixture)
    settled,
    until,
)


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
