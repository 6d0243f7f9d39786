"""A Responses API id shared by gateway replicas through Redis (gateway/shared_response_ids.py)
is written there before the client can read it: two replicas served in this process share a
private redis-server, replica A's write to it is slowed, and a client that sends the follow-up to
replica B the moment it has read the id from A's answer still reaches the server that stored it."""

import asyncio
import signal
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.cli_args import parser
from gateway.procs import TEST_TOKEN, free_port, start_redis, stop_all, wait_redis
from gateway.raw_send import RawBody
from tests.raw_client import Client
from gateway.response_ids import Owner
from gateway.response_tap import IdTap, TappedBody, answer_id
from gateway.server import build, http_server
from gateway.shared_response_ids import SharedResponseIds
from tests import vllm_data as vd
from tests.fake_vllm_gateway import start_fake
from workers.listen import listen

SLOW_WRITE_S = 1.0  # replica A's Redis write, against a client that reads and sends at once


@pytest.fixture
def fleet(tmp_path):
    redis = start_redis(log_dir=str(tmp_path))
    procs = [redis, *(start_fake(tmp_path, f"fake-vllm-{i}") for i in range(2))]
    try:
        wait_redis(redis)
        yield f"redis://127.0.0.1:{redis.port}", [p.wait_ready("/health", 60) for p in procs[1:]]
    finally:
        stop_all(procs)


async def until(check, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def first_id(chunks: AsyncIterator[bytes], streamed: bool) -> str:
    """The response id in an answer's `chunks`, read as soon as they name it whole."""
    head = b""
    async for chunk in chunks:
        head += chunk
        rid = answer_id(head, streamed)
        if rid is not None:
            return rid
    raise AssertionError(f"no response id in {head[:300]!r}")


def test_a_follow_up_sent_to_another_replica_the_moment_the_id_is_read_finds_its_server(fleet):
    url, fakes = fleet
    ports = [free_port(), free_port()]
    argvs = [
        ["--port", str(port), "--redis", url, "--internal-token", TEST_TOKEN, "--model", vd.MODEL]
        + [arg for f in fakes for arg in ("--worker", f"vllm:{f.url}")]
        for port in ports
    ]
    args = [parser().parse_args(argv) for argv in argvs]
    one, two = (build(a) for a in args)
    servers = [http_server(gw, a) for gw, a in zip((one, two), args)]

    async def go() -> list[tuple[int, str, str]]:
        serving = []
        for server, port in zip(servers, ports):  # one after the other: their tokenizers load in threads
            serving.append(asyncio.create_task(server.serve(sockets=[listen("127.0.0.1", port, "test gateway")])))
            await until(lambda: server.started)
        try:
            await until(lambda: all(sum(w.available for w in gw.fleet.workers.values()) == 2 for gw in (one, two)))
            shared = one.responses.shared
            assert shared is not None
            shared.wait_s = 60.0  # this test's bound on the hold, not the one it checks
            client = shared.client()
            write = client.set

            async def slow_write(*a, **kw):
                await asyncio.sleep(SLOW_WRITE_S)
                return await write(*a, **kw)

            client.set = slow_write  # type: ignore[method-assign]
            got = []
            async with httpx.AsyncClient(timeout=60) as c:
                for streamed in (True, False):
                    body = {"model": vd.MODEL, "input": "hi", "stream": streamed}
                    async with c.stream("POST", f"http://127.0.0.1:{ports[0]}/v1/responses", json=body) as r:
                        assert r.status_code == 200
                        chunks = r.aiter_raw()
                        rid = await first_id(chunks, streamed)
                        follow = await c.post(
                            f"http://127.0.0.1:{ports[1]}/v1/responses",
                            json={"model": vd.MODEL, "input": "and then?", "previous_response_id": rid},
                        )
                        got.append(
                            (follow.status_code, follow.headers["x-kvgate-worker"], r.headers["x-kvgate-worker"])
                        )
                        async for _ in chunks:  # the rest of A's answer
                            pass
            return got
        finally:
            for s in servers:
                s.handle_exit(signal.SIGTERM, None)
            await asyncio.gather(*serving)

    for status, worker, holder in asyncio.run(go()):
        assert (status, worker) == (200, holder)


def test_the_chunk_that_completes_an_id_and_those_after_wait_for_its_hold_then_go_in_order():
    answer = b'{"id":"resp_0a1b","object":"response","output":[]}'
    cuts = [answer[:9], answer[9:17], answer[17:30], answer[30:]]  # the id's closing quote is in the second

    async def go() -> list[list[bytes]]:
        written = asyncio.Event()
        client = Client()
        body = TappedBody(RawBody(client), [IdTap(False, lambda rid: asyncio.ensure_future(written.wait()))])
        seen = [[body.write(c) for c in cuts], list(client.got)]
        draining = asyncio.ensure_future(body.drain())
        await asyncio.sleep(0)
        seen.append(list(client.got))  # the write not yet answered
        written.set()
        await draining
        return [*seen, client.got]

    wrote, before, waiting, after = asyncio.run(go())
    assert wrote == [True, False, False, False]  # held from the id's end: the relay stops reading
    assert before == waiting == [b"%x\r\n%s\r\n" % (len(cuts[0]), cuts[0])]
    assert after[1:] == [b"%x\r\n%s\r\n" % (len(answer) - 9, answer[9:])]


def test_a_write_redis_is_slow_to_answer_is_waited_for_at_most_its_bound_and_none_while_redis_fails():
    """Slow: the bytes go on after `wait_s`, the write still going. Failing (nothing listens):
    the first create waits for the refusal, later ones not at all."""

    async def go() -> tuple[bool, bool, bool, bool]:
        shared = SharedResponseIds("redis://127.0.0.1:1", "fleet-secret", wait_s=0.01)
        answered = asyncio.Event()
        calls = []

        async def stuck(*a, **kw):
            calls.append(a)
            await answered.wait()

        shared.client().set = stuck  # type: ignore[method-assign]
        hold = shared.put("resp_1", Owner("w0", "a"), 60.0)
        assert hold is not None
        await hold
        slow = (len(calls), answered.is_set()) == (1, False)
        answered.set()
        await shared.close()
        down = SharedResponseIds("redis://127.0.0.1:1", "fleet-secret", wait_s=60.0)  # nothing listens there
        first = down.put("resp_1", Owner("w0", "a"), 60.0)
        assert first is not None
        await first
        later = down.put("resp_2", Owner("w0", "a"), 60.0)
        await down.close()
        return slow, down.failing, later is None, shared.failing

    assert asyncio.run(go()) == (True, True, True, False)
