"""The responses the gateway stores for kvgate's workers, shared by replicas through a private
redis-server (gateway/shared_response_store.py): another tenant's id is a plain miss there."""

import asyncio

import pytest

from gateway.procs import start_redis, stop_all, wait_redis
from gateway.response_request import Message
from gateway.response_store import ResponseStore
from gateway.shared_response_store import SharedResponseStore
from gateway.stored_response import StoredResponse

TOKEN = "fleet-secret"


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
            assert writer.put(record("resp_a"))
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
