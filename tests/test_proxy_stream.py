"""How the proxy commits a stream: only at its first token event; pure, on a fake response."""

import asyncio
import json

import pytest

from gateway.proxy import Proxy, StreamFailed, UpstreamFailed, UpstreamTimeout, WorkerLost
from gateway.tap import StreamTap


class FakeResponse:
    def __init__(self, chunks: list[bytes], then_hang: bool = False):
        self.chunks, self.then_hang = list(chunks), then_hang

    async def read_some(self) -> bytes:
        if self.chunks:
            return self.chunks.pop(0)
        if self.then_hang:
            await asyncio.sleep(3600)
        return b""


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = event({"choices": [{"delta": {"role": "assistant"}}]})
TOKEN = event({"choices": [{"delta": {"content": "hi"}}]})


def first_token(
    chunks: list[bytes], kind: str = "chat", then_hang: bool = False, timeout: float = 5.0, lost: bool = False
) -> bytes:
    async def run():
        future = asyncio.get_running_loop().create_future()
        if lost:
            future.set_result("its engine is not running")
        proxy = Proxy(first_byte_timeout=timeout)
        return await proxy.first_token(
            FakeResponse(chunks, then_hang), StreamTap(kind, 0.0), None, future, asyncio.get_running_loop().time()
        )

    return asyncio.run(run())


def test_the_role_event_is_held_until_the_first_token_arrives():
    head = first_token([ROLE, TOKEN[:10], TOKEN[10:] + TOKEN], then_hang=True)
    assert head == ROLE + TOKEN + TOKEN  # whole events, read until one carried a token


def test_an_engine_gone_error_before_the_first_token_is_the_gateways_to_retry():
    gone = event({"error": {"message": "the engine has stopped", "type": "server_error", "code": "engine_stopped"}})
    with pytest.raises(StreamFailed):
        first_token([ROLE, gone, b"data: [DONE]\n\n"])
    failed = event({"error": {"message": "step raised", "type": "server_error", "code": "engine_error"}})
    assert first_token([failed, b"data: [DONE]\n\n"], kind="completion") == failed  # the request's own: passed on


def test_a_stream_that_ends_or_stalls_before_its_first_token_is_retried():
    with pytest.raises(UpstreamFailed):
        first_token([ROLE])
    with pytest.raises(UpstreamTimeout):
        first_token([ROLE], then_hang=True, timeout=0.2)
    with pytest.raises(UpstreamFailed):
        first_token([ROLE, TOKEN[:10]])  # cut inside its first token event
    with pytest.raises(WorkerLost):
        first_token([ROLE], then_hang=True, lost=True)  # the fleet took the worker out meanwhile


def test_a_chat_stream_of_n_choices_has_its_first_token_after_n_role_events():
    tap = StreamTap("chat", 0.0, choices=2)
    role = b'data: {"choices":[{"index":%d,"delta":{"role":"assistant","content":""}}]}\n\n'
    tap.feed(role % 0 + role % 1)
    assert tap.ttft is None
    tap.feed(b'data: {"choices":[{"index":1,"delta":{"content":"x"}}]}\n\n')
    assert tap.ttft is not None
