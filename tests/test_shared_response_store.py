"""The responses the gateway stores for kvgate's workers, shared by replicas through a private
redis-server (gateway/shared_response_store.py): each tenant's quota holds in Redis, whichever
replica writes and however records expire; another tenant's id is a plain miss there; and an
answer ends only once Redis has its record, so a follow-up sent to another replica at once
finds it."""

import asyncio
import json
import signal

import httpx
import pytest
import redis

from gateway.cli_args import parser
from gateway.procs import TEST_TOKEN, Worker, free_port, start_redis, stop_all, wait_redis
from gateway.server import build, http_server
from gateway.response_request import Message
from gateway.response_store import ResponseStore
from gateway import shared_response_store
from gateway.shared_response_store import SharedResponseStore
from gateway.stored_response import StoredResponse
from workers.kv import redis_schema as rs
from workers.listen import listen

TOKEN = "fleet-secret"
RECORDS = "kvgate:stored-response:*"


@pytest.fixture
def redis_url(tmp_path):
    server = start_redis(log_dir=str(tmp_path))
    try:
        wait_redis(server)
        yield f"redis://127.0.0.1:{server.port}/0"
    finally:
        stop_all([server])


def record(rid: str, tenant: str = "a", words: int = 1) -> StoredResponse:
    response = {"id": rid, "object": "response", "model": "m", "output": []}
    return StoredResponse.of(rid, tenant, response, (Message("user", "w " * words),))


async def stored(store: ResponseStore, rid: str, tenant: str) -> StoredResponse:
    """`rid` of `tenant` once Redis has it, read through a replica that never held it."""
    for _ in range(200):
        found = await ResponseStore(shared=store.shared).find(rid, tenant)
        if found is not None:
            return found
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rid} never reached redis")


def test_another_tenants_id_costs_what_an_unknown_one_does(redis_url):
    """Its record was fetched, its signature checked and its JSON parsed before its tenant was
    compared: a client could time one against an unknown id. The key names the tenant (a keyed
    hash of it), so another tenant's lookup is the same plain miss as an unknown id's."""

    async def go() -> tuple[list[str], bool, bool, bool]:
        writer = ResponseStore(shared=SharedResponseStore(redis_url, TOKEN))
        reader = ResponseStore(shared=SharedResponseStore(redis_url, TOKEN))
        checked: list[str] = []
        check = reader.shared.checked

        def counted(rid, *a):
            checked.append(rid)
            return check(rid, *a)

        reader.shared.checked = counted
        try:
            writer.put(record("resp_a"))
            await stored(writer, "resp_a", "a")
            other = await reader.find("resp_a", "b")
            unknown = await reader.find("resp_unknown", "b")
            seen_before = list(checked)
            own = await reader.find("resp_a", "a")
            return seen_before, other is None, unknown is None, own == record("resp_a")
        finally:
            await writer.close()
            await reader.close()

    seen_before, other_missed, unknown_missed, own_found = asyncio.run(go())
    assert other_missed and unknown_missed and own_found
    assert seen_before == []  # neither read a record, nor checked a signature


def held(url: str) -> dict[str, int]:
    """The stored responses' records in Redis: key -> bytes."""
    r = redis.Redis.from_url(url)
    try:
        return {k.decode(): r.strlen(k) for k in r.scan_iter(RECORDS)}
    finally:
        r.close()


def test_with_api_keys_redis_holds_a_tenants_quota_of_responses_not_every_one(redis_url):
    """Each create wrote its whole conversation to Redis for a day, bounded by nothing: a
    tenant's quota (here the default, a quarter of --response-ids: 2) holds there too."""
    argv = ["--redis", redis_url, "--internal-token", TEST_TOKEN, "--model", "smollm2-135m", "--response-ids", "8"]
    gw = build(parser().parse_args([*argv, "--api-key", "sk-a", "--api-key", "sk-b"]))
    assert gw.responses.local is not None
    store = gw.responses.local.store

    async def go() -> None:
        try:
            store.put(record("resp_b0", "b"))
            await stored(store, "resp_b0", "b")
            for i in range(10):
                store.put(record(f"resp_a{i}"))
                await stored(store, f"resp_a{i}", "a")
        finally:
            await store.close()

    asyncio.run(go())
    assert len(held(redis_url)) == 3


def test_a_tenants_quota_holds_in_redis_across_replicas_and_expiry(redis_url):
    """Two replicas write one tenant's responses in turn: Redis keeps its newest within its
    entries or its bytes, and every other tenant's; a lost counter is counted again from the
    tenant's index."""
    size = len(record("resp_a00").encoded()) + 64  # in Redis: its signature, then its JSON

    async def go(quota: dict) -> tuple[list[str], int, int]:
        r = redis.Redis.from_url(redis_url)
        r.flushdb()  # this test's own redis-server
        replicas = [ResponseStore(shared=SharedResponseStore(redis_url, TOKEN, **quota)) for _ in range(2)]
        counter = rs.stored_response_bytes_key(SharedResponseStore(redis_url, TOKEN).tenant_tag("a"))
        try:
            replicas[0].put(record("resp_b00", "b"))
            await stored(replicas[0], "resp_b00", "b")
            for i in range(6):
                replicas[i % 2].put(record(f"resp_a{i:02}"))
                await stored(replicas[i % 2], f"resp_a{i:02}", "a")
            kept = sorted(k.rsplit(":", 1)[1] for k in held(redis_url))
            counted = int(r.get(counter))
            r.delete(counter)
            replicas[1].put(record("resp_a06"))
            await stored(replicas[1], "resp_a06", "a")
            return kept, counted, int(r.get(counter))
        finally:
            for replica in replicas:
                await replica.close()
            r.close()

    newest = ["resp_a03", "resp_a04", "resp_a05", "resp_b00"]
    assert asyncio.run(go({"tenant_size": 3})) == (newest, 3 * size, 3 * size)
    assert asyncio.run(go({"tenant_bytes": 3 * size})) == (newest, 3 * size, 3 * size)


def test_what_expired_in_redis_no_longer_counts_against_its_tenant(redis_url):
    size = len(record("resp_c00").encoded()) + 64

    async def go() -> tuple[int, int]:
        store = ResponseStore(ttl_s=0.2, shared=SharedResponseStore(redis_url, TOKEN, tenant_size=3))
        r = redis.Redis.from_url(redis_url)
        tag = SharedResponseStore(redis_url, TOKEN).tenant_tag("c")
        try:
            for i in range(3):
                store.put(record(f"resp_c{i:02}", "c"))
            await stored(store, "resp_c02", "c")
            while held(redis_url):
                await asyncio.sleep(0.05)  # until they expire
            store.ttl_s = 60.0
            store.put(record("resp_c03", "c"))
            await stored(store, "resp_c03", "c")
            return int(r.get(rs.stored_response_bytes_key(tag))), r.zcard(rs.stored_responses_key(tag))
        finally:
            await store.close()
            r.close()

    assert asyncio.run(go()) == (size, 1)


SLOW_WRITE_S = 1.0  # replica A's Redis write, against a client that reads and sends at once


async def until(check, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def answer_end(r, streamed: bool) -> dict:
    """The response in a create's answer, read the instant it ends: a whole one's last byte, a
    stream's last event (response.completed or response.incomplete)."""
    if not streamed:
        return json.loads(await r.aread())
    text = ""
    async for chunk in r.aiter_text():
        text += chunk
        for name in ("response.completed", "response.incomplete"):
            if f"event: {name}\ndata: " in text and text.endswith("\n\n"):
                data = text.split(f"event: {name}\ndata: ", 1)[1].split("\n", 1)[0]
                return json.loads(data)["response"]
    raise AssertionError(f"no final event in {text[-300:]!r}")


def test_a_follow_up_sent_to_another_replica_the_instant_the_answer_ends_finds_its_history(redis_url, tmp_path):
    """The store's Redis write went out in the background as the answer was returned: a
    follow-up at another replica within that round trip was a 404. Replica A's write is slowed;
    the answer (a whole one, or a stream's last event) waits for it."""
    worker = Worker(worker_id="w0", log_dir=str(tmp_path))
    ports = [free_port(), free_port()]
    argvs = [
        ["--port", str(port), "--redis", redis_url, "--internal-token", TEST_TOKEN, "--model", "smollm2-135m"]
        + ["--worker", worker.url]
        for port in ports
    ]
    try:
        worker.ready()
        args = [parser().parse_args(argv) for argv in argvs]
        one, two = (build(a) for a in args)
        servers = [http_server(gw, a) for gw, a in zip((one, two), args)]

        async def go() -> list[tuple[int, str]]:
            serving = []
            for server, port in zip(servers, ports):  # one after the other: their tokenizers load in threads
                serving.append(asyncio.create_task(server.serve(sockets=[listen("127.0.0.1", port, "test gateway")])))
                await until(lambda: server.started)
            try:
                await until(lambda: all(any(w.available for w in gw.fleet.workers.values()) for gw in (one, two)))
                assert one.responses.local is not None and one.responses.local.store.shared is not None
                shared = one.responses.local.store.shared
                shared.wait_s = 60.0  # this test's bound on the hold, not the one it checks
                client = shared.client()
                for name in ("evalsha", "set"):
                    write = getattr(client, name)

                    async def slow(*a, write=write, **kw):
                        await asyncio.sleep(SLOW_WRITE_S)
                        return await write(*a, **kw)

                    setattr(client, name, slow)
                got = []
                async with httpx.AsyncClient(timeout=60) as c:
                    for streamed in (True, False):
                        body = {"model": "smollm2-135m", "input": "hi", "max_output_tokens": 4, "stream": streamed}
                        async with c.stream("POST", f"http://127.0.0.1:{ports[0]}/v1/responses", json=body) as r:
                            assert r.status_code == 200
                            made = await answer_end(r, streamed)
                            follow = await c.post(
                                f"http://127.0.0.1:{ports[1]}/v1/responses",
                                json={
                                    "model": "smollm2-135m",
                                    "input": "and?",
                                    "max_output_tokens": 4,
                                    "previous_response_id": made["id"],
                                },
                            )
                            got.append((follow.status_code, follow.text[:300]))
                return got
            finally:
                for s in servers:
                    s.handle_exit(signal.SIGTERM, None)
                await asyncio.gather(*serving)

        for status, text in asyncio.run(go()):
            assert status == 200, text
    finally:
        stop_all([worker])


def test_a_delete_at_one_replica_holds_at_every_replica_and_frees_its_bytes(redis_url):
    """Replica B holds its own copy of a response replica A deletes: B no longer serves it (the
    mark in Redis), Redis no longer holds it, and the tenant's bytes there drop; the mark takes
    the record's entry of the tenant's quota (so no tenant makes Redis hold marks past its
    quota) and goes, oldest first, as any entry does. Another tenant's record is untouched."""
    size = len(record("resp_a0").encoded()) + 64

    async def go() -> tuple:
        r = redis.Redis.from_url(redis_url)
        a, b = (ResponseStore(shared=SharedResponseStore(redis_url, TOKEN, tenant_size=3)) for _ in range(2))
        tag = a.shared.tenant_tag("a")
        try:
            for rid, tenant in (("resp_a0", "a"), ("resp_a1", "a"), ("resp_a2", "a"), ("resp_b0", "b")):
                a.put(record(rid, tenant))
                await stored(a, rid, tenant)
            copy = await b.find("resp_a1", "a")  # B's own copy now
            assert copy is not None and b.get("resp_a1", "a") is not None
            bytes_before = int(r.get(rs.stored_response_bytes_key(tag)))
            await a.delete(copy)
            gone_here, gone_there = await a.find("resp_a1", "a"), await b.find("resp_a1", "a")
            mark_ttl_s = r.pttl(rs.deleted_response_key(tag, "resp_a1")) / 1000
            counted = (
                r.zcard(rs.stored_responses_key(tag)),
                bytes_before - int(r.get(rs.stored_response_bytes_key(tag))),
            )
            a.put(record("resp_a3"))
            await stored(a, "resp_a3", "a")
            kept = sorted(k.rsplit(":", 1)[1] for k in held(redis_url))
            return gone_here, gone_there, b.get("resp_a1", "a"), mark_ttl_s, counted, kept
        finally:
            await a.close()
            await b.close()
            r.close()

    here, there, copy_left, mark_ttl_s, counted, kept = asyncio.run(go())
    assert here is None and there is None and copy_left is None
    assert 0 < mark_ttl_s <= ResponseStore().ttl_s
    assert counted == (3, size)  # two records and the mark
    assert kept == ["resp_a2", "resp_a3", "resp_b0"]  # resp_a0, the oldest entry, made room


def test_a_delete_redis_does_not_answer_deletes_nothing():
    """Redis down: the delete raises LookupFailed (the gateway's 503) and the replica's own copy
    stays, as does whatever Redis holds: a 200 would say it is gone while replicas still serve it."""
    from gateway.shared_records import LookupFailed

    async def go() -> tuple[bool, StoredResponse | None]:
        store = ResponseStore(shared=SharedResponseStore(f"redis://127.0.0.1:{free_port()}/0", TOKEN))
        store.remember(record("resp_x"), 60)
        try:
            await store.delete(record("resp_x"))
        except LookupFailed:
            return True, store.get("resp_x", "a")
        finally:
            await store.close()
        return False, None

    raised, kept = asyncio.run(go())
    assert raised and kept == record("resp_x")


def test_a_write_that_lands_after_its_delete_stores_nothing_and_a_marked_record_is_no_record(redis_url):
    """A create's write may reach Redis after its response was deleted (its answer released
    while Redis stalled): the write stores nothing. A record read back under a deleted mark is
    no record, for any replica that never held a copy."""

    async def go() -> tuple:
        r = redis.Redis.from_url(redis_url)
        a = ResponseStore(shared=SharedResponseStore(redis_url, TOKEN))
        tag = a.shared.tenant_tag("a")
        try:
            late = record("resp_late")
            a.remember(late, 60)
            await a.delete(late)
            await a.shared._put(late, a.shared.sign("resp_late", late.encoded()) + late.encoded(), 60)
            late_stored = r.exists(rs.stored_response_key(tag, "resp_late"))
            a.put(record("resp_kept"))
            await stored(a, "resp_kept", "a")
            r.set(rs.deleted_response_key(tag, "resp_kept"), "1")
            return late_stored, await ResponseStore(shared=a.shared).find("resp_kept", "a")
        finally:
            await a.close()
            r.close()

    late_stored, marked = asyncio.run(go())
    assert not late_stored and marked is None


def test_a_delete_whose_answer_timed_out_stands_when_its_mark_is_there(redis_url):
    """Redis ran the script but its answer came too late: the mark says the delete happened, so
    it is no 503 (a client retrying it would then get a 404 for a delete that worked)."""
    from redis.exceptions import TimeoutError as RedisTimeout

    async def go() -> StoredResponse | None:
        a = ResponseStore(shared=SharedResponseStore(redis_url, TOKEN))
        try:
            a.put(record("resp_slow"))
            await stored(a, "resp_slow", "a")
            real = a.shared.client().register_script(shared_response_store.DELETE)

            async def ran_then_timed_out(**kw):
                await real(**kw)
                raise RedisTimeout("answer timed out")

            a.shared.delete_script = ran_then_timed_out
            await a.delete(record("resp_slow"))
            return a.get("resp_slow", "a")
        finally:
            await a.close()

    assert asyncio.run(go()) is None


def test_while_redis_has_just_failed_a_local_copy_is_served_without_asking_it(redis_url):
    """Each check of a copy against Redis waits out its timeout when Redis stalls: after a
    failure, copies are served for a while without asking."""

    async def go() -> tuple[int, int]:
        store = ResponseStore(shared=SharedResponseStore(f"redis://127.0.0.1:{free_port()}/0", TOKEN))
        store.remember(record("resp_local"), 60)
        asked = []
        client = store.shared.client()
        exists = client.exists

        async def counted(*keys):
            asked.append(keys)
            return await exists(*keys)

        client.exists = counted
        try:
            first = await store.find("resp_local", "a")
            before = len(asked)
            second = await store.find("resp_local", "a")
            assert first == second == record("resp_local")
            return before, len(asked)
        finally:
            await store.close()

    before, after = asyncio.run(go())
    assert before == 1 and after == 1
