"""The gateway's own upstream client (gateway/upstream.py) and the stream relay on it
(gateway/proxy.py, gateway/relay.py), against a real worker stand-in process that misbehaves on cue
(tests/scripted_upstream.py): a stream cut mid-way, a stream gone silent, a stream the
gateway closes early, a relay whose client end fails (the gateway's fault, not the worker's), keep-alive connections reused and dropped once the server closed them, a
whole answer bounded by the answer timeout and not the first-byte one."""

import asyncio
import sys

import httpx
import pytest
import uvloop

from gateway import pd
from gateway.procs import Proc, free_port, stop_all, wait_for
from gateway.proxy import AnswerTimeout, Proxy, UpstreamFailed, UpstreamTimeout
from gateway.relay import DONE, BodyPassThrough, PassThrough, Relay
from gateway.tap import StreamTap
from tests.scripted_upstream import LATE_BODY

EVENT = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    port = free_port()
    proc = Proc(
        "scripted", [sys.executable, "tests/scripted_upstream.py", str(port)], port, str(tmp_path_factory.mktemp("up"))
    )
    try:
        yield proc.wait_ready()
    finally:
        stop_all([proc])


def counts(upstream: Proc) -> dict:
    return httpx.get(upstream.url + "/log").json()


class Client:
    """The client side of a relayed stream, as `RawBody` offers it: what was written to it;
    a `slow` one says it is full after every write until it has drained."""

    def __init__(self, slow: bool = False):
        self.got, self.slow, self.drains = b"", slow, 0

    def write(self, body: bytes) -> bool:
        self.got += body
        return not self.slow

    async def drain(self) -> None:
        self.drains += 1
        await asyncio.sleep(0.01)


def relay(
    url: str, path: str, idle_timeout: float = 30.0, client: Client | None = None
) -> tuple[bytes, list[Exception]]:
    """Open a stream on `path`, read it to its first token, relay the rest: (what the client
    got, the failures `on_error` was told about)."""
    failures: list[Exception] = []
    client = client or Client()

    def failed(e: Exception) -> str:
        failures.append(e)
        return "it failed"

    async def run() -> bytes:
        proxy = Proxy(idle_timeout=idle_timeout)
        resp = await proxy.open(url, path, b"{}", {"content-type": "application/json"})
        tap = StreamTap("completion", 0.0)
        head = await proxy.first_token(resp, tap, None, None, 0.0)
        passing = PassThrough(resp, Relay(tap, head), idle_timeout, failed, lambda: None, {})
        try:
            last = await passing.relay_upstream(client)  # a RawBody in duck type
            client.got += last
        finally:
            resp.release()
        return client.got

    return uvloop.run(run()), failures


def test_a_whole_stream_passes_through_as_it_came(upstream):
    assert relay(upstream.url, "/stream") == (EVENT + EVENT + DONE, [])


def test_a_slow_client_pauses_the_stream_and_loses_nothing(upstream):
    slow = Client(slow=True)
    assert relay(upstream.url, "/slow", client=slow) == (EVENT * 20 + DONE, [])
    assert slow.drains >= 2  # reading stopped for room more than once, and went on each time


def test_a_stream_cut_mid_way_ends_with_its_whole_events_then_an_error_event(upstream):
    got, failures = relay(upstream.url, "/drop")
    assert got.startswith(EVENT + EVENT) and got.endswith(DONE)
    assert b'"message": "it failed"' in got[2 * len(EVENT) :]
    assert len(failures) == 1 and type(failures[0]) is UpstreamFailed


def test_a_stream_gone_silent_ends_with_an_error_event_after_the_idle_timeout(upstream):
    got, failures = relay(upstream.url, "/hang", idle_timeout=0.3)
    assert got.startswith(EVENT) and got.endswith(DONE)
    assert len(failures) == 1 and isinstance(failures[0], UpstreamTimeout)


class Failing(Client):
    """A client end whose write number `at` raises, as a gateway bug would (uvicorn's HEAD
    answer had no chunked framing for `RawBody.write` to assert)."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.writes, self.aborted = at, 0, False

    def write(self, body: bytes) -> bool:
        self.writes += 1
        if self.writes == self.at:
            raise AssertionError("the client end failed")
        return super().write(body)

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize("path, at", [("/stream", 1), ("/slow", 2)])  # the body there before the relay, then after
def test_a_relay_whose_client_end_fails_cuts_the_client_off_and_blames_no_worker(upstream, path, at):
    failures: list[Exception] = []

    def failed(e: Exception) -> str:
        failures.append(e)
        return "it failed"

    async def run() -> tuple[bytes | None, bool]:
        proxy = Proxy()
        resp = await proxy.open(upstream.url, path, b"{}", {})
        passing = BodyPassThrough(resp, 200, 30.0, failed, lambda: None, {})
        try:
            return await passing.relay_upstream(client), resp.closed  # a RawBody in duck type
        finally:
            resp.release()

    client = Failing(at)
    assert uvloop.run(run()) == (None, True)  # nothing more for the client; the worker's connection not reused
    assert client.aborted and client.writes == at and failures == []


def test_a_stream_closed_before_its_end_closes_the_workers_connection(upstream):
    before = counts(upstream)["hang_closed"]

    async def run() -> None:
        proxy = Proxy()
        resp = await proxy.open(upstream.url, "/hang", b"{}", {})
        assert await proxy.first_token(resp, StreamTap("completion", 0.0), None, None, 0.0) == EVENT
        resp.release()  # what a client's disconnect does to its stream

    uvloop.run(run())
    wait_for(lambda: counts(upstream)["hang_closed"] == before + 1, timeout=10, what="the worker to see it closed")


def test_keep_alive_connections_are_reused_until_the_server_closes_them(upstream):
    before = counts(upstream)["whole_connections"]

    async def run() -> list[bytes]:
        proxy = Proxy()
        bodies = []
        for pause in (0.0, 0.0, 0.6):  # the server closes a connection idle for 0.3 s
            await asyncio.sleep(pause)
            resp = await proxy.open(upstream.url, "/whole", b"{}", {})
            bodies.append(await proxy.read(resp))
        await proxy.close()
        return bodies

    bodies = uvloop.run(run())
    assert bodies == [b'{"usage":{"completion_tokens":1}}'] * 3
    assert counts(upstream)["whole_connections"] == before + 2  # the first reused once, then a fresh one


def test_a_whole_answer_is_bounded_by_the_answer_timeout_not_the_first_byte_one(upstream):
    """/late answers whole after 1 s. With a 0.3 s first-byte timeout a whole answer still
    comes (the worker sends it only after its last token); a wait that is not for a whole
    answer (a stream's head) and a P/D prefill leg (one token: a first token's work) are cut at 0.3 s."""

    async def run() -> tuple[bytes, type, int | None]:
        proxy = Proxy(first_byte_timeout=0.3, answer_timeout=30.0)
        body = await proxy.read(await proxy.open(upstream.url, "/late", b"{}", {}, whole=True))
        try:
            await proxy.open(upstream.url, "/late", b"{}", {})
            cut: type = type(None)
        except UpstreamTimeout as e:
            cut = type(e)
        cached = await pd.run_prefill(proxy, upstream.url, "/late", b"{}", {})
        await proxy.close()
        return body, cut, cached

    assert uvloop.run(run()) == (LATE_BODY, UpstreamTimeout, None)


def test_a_whole_answer_past_the_answer_timeout_is_cut_and_its_connection_closed(upstream):
    """Past the answer timeout the wait ends in `AnswerTimeout` (not retried: gateway/app.py)
    and the worker's connection is closed, which is how the worker learns to abort it."""
    before = counts(upstream)["late_cut"]

    async def run() -> None:
        proxy = Proxy(first_byte_timeout=30.0, answer_timeout=0.3)
        with pytest.raises(AnswerTimeout):
            await proxy.open(upstream.url, "/late", b"{}", {}, whole=True)

    uvloop.run(run())
    wait_for(lambda: counts(upstream)["late_cut"] == before + 1, timeout=10, what="the worker to see it closed")
