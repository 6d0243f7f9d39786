"""The responses the gateway stores for kvgate's workers: the in-memory store's bounds (entries,
bytes, age) and tenants, the records' JSON, and the signed records replicas share in Redis."""

import asyncio
import json
import tracemalloc

import pytest

from gateway.cli_args import parser
from gateway.response_request import Message
from gateway.response_store import ResponseStore
from gateway.server import build
from gateway.shared_records import LookupFailed
from gateway.shared_response_store import SharedResponseStore
from gateway.stored_response import StoredResponse


def record(rid: str, tenant: str = "a", words: int = 1) -> StoredResponse:
    response = {"id": rid, "object": "response", "model": "m", "output": []}
    return StoredResponse.of(rid, tenant, response, (Message("user", "w " * words),))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_store_is_bounded_by_entries_bytes_and_age_and_scoped_to_its_tenant():
    clock = Clock()
    size = record("resp_0").held_bytes()
    store = ResponseStore(size=3, ttl_s=10.0, max_bytes=size * 3, clock=clock)

    def find(rid: str, tenant: str = "a") -> StoredResponse | None:
        return asyncio.run(store.find(rid, tenant))

    for i in range(3):
        store.put(record(f"resp_{i}"))
    assert find("resp_0") == record("resp_0") and find("resp_0", "b") is None  # another tenant's: unknown
    store.put(record("resp_3"))  # past 3 entries: the least recently used (resp_1) goes
    assert find("resp_1") is None and len(store) == 3
    store.put(record("resp_big", words=3))  # past the byte bound: as many go as it takes
    assert store.bytes <= size * 3 and find("resp_big") is not None and find("resp_0") is None
    store.put(record("resp_huge", words=10 * size))  # alone past the bound: not stored
    assert store.get("resp_huge", "a") is None
    clock.now = 10.0
    assert find("resp_big") is None and len(store) == 1  # expired on its lookup
    with pytest.raises(ValueError):
        ResponseStore(max_bytes=0)


def test_a_stored_record_round_trips_and_a_bad_one_is_refused():
    r = record("resp_1")
    d = json.loads(r.encoded())
    assert StoredResponse.from_json(d) == r
    for bad in (
        {**d, "id": "resp x"},
        {**d, "tenant": 5},
        {**d, "response": {"id": "resp_2", "object": "response"}},
        {**d, "conversation": [{"role": "tool", "content": "x"}]},
        {**d, "conversation": [{"role": "user", "content": "x", "extra": 1}]},
    ):
        with pytest.raises(ValueError):
            StoredResponse.from_json(bad)


def test_what_the_store_holds_stays_within_a_small_factor_of_what_it_counts():
    """A conversation held as message objects took five times its JSON's bytes (400 records of
    many empty messages: 21.1 MB counted, 108 MB held), so --response-store-mb bounded a fifth
    of what the store used. Each record is built as a replica reads one from Redis, a fresh
    object per message."""
    empty = {"role": "user", "content": ""}
    raws = [
        json.dumps({**json.loads(record(f"resp_{i}").encoded()), "conversation": [empty] * 1000}).encode()
        for i in range(40)
    ]
    store = ResponseStore(size=1000, max_bytes=1 << 30)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for raw in raws:
            store.put(StoredResponse.from_json(json.loads(raw)))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(store) == len(raws) and held <= 1.5 * store.bytes, (held, store.bytes)


def test_a_shared_record_counts_only_when_the_fleets_token_signed_it_for_its_id_and_tenant():
    shared = SharedResponseStore("redis://127.0.0.1:1", "fleet-secret")
    r = record("resp_1")
    good = shared.sign("resp_1", r.encoded()) + r.encoded()
    assert shared.parse("resp_1", "a", good) == r
    other_tenant = StoredResponse("resp_1", "b", r.model, r.response, r.conversation).encoded()
    forged = [
        ("resp_2", "a", good),  # copied under another id
        ("resp_1", "b", good),  # copied under another tenant's key: it names its own
        ("resp_1", "a", good[:64] + other_tenant),  # handed to another tenant
        ("resp_1", "a", SharedResponseStore("redis://x", "other").sign("resp_1", r.encoded()) + r.encoded()),
        ("resp_1", "a", b"x" * 10),
    ]
    for rid, tenant, bad in forged:
        assert shared.parse(rid, tenant, bad) is None
    wrong_id = record("resp_2").encoded()  # signed for resp_1, but the record says resp_2
    assert shared.parse("resp_1", "a", shared.sign("resp_1", wrong_id) + wrong_id) is None
    assert shared.malformed == len(forged) + 1
    tags = {shared.tenant_tag(t) for t in ("a", "b", "")} | {SharedResponseStore("redis://x", "o").tenant_tag("a")}
    assert len(tags) == 4 and all(len(t) == 32 for t in tags)  # keyed by the token: no tenant shows in a key


def test_a_tenant_past_its_quota_forgets_its_own_least_recently_used_never_anothers():
    one = record("resp_a0").held_bytes()
    for quota in ({"tenant_size": 3}, {"tenant_bytes": one * 3}):
        store = ResponseStore(size=100, max_bytes=one * 100, **quota)
        store.put(record("resp_b0", "b"))
        for i in range(5):
            store.put(record(f"resp_a{i}"))
            if i == 2:
                assert store.get("resp_a0", "a") is not None  # used: its tenant's most recent
        assert list(store.tenants["a"].entries) == ["resp_a0", "resp_a3", "resp_a4"]
        assert store.get("resp_b0", "b") is not None and len(store) == 4, quota


def test_past_a_store_wide_bound_the_tenant_holding_the_most_forgets_its_least_recently_used():
    one = record("resp_a0").held_bytes()
    for bound in ({"size": 4}, {"max_bytes": one * 4}):
        store = ResponseStore(**{"size": 100, "max_bytes": one * 100, **bound}, tenant_size=3)
        for rid, tenant in (("resp_a0", "a"), ("resp_a1", "a"), ("resp_a2", "a"), ("resp_b0", "b"), ("resp_c0", "c")):
            store.put(record(rid, tenant))
        assert store.get("resp_a0", "a") is None and len(store) == 4, bound
        assert all(store.get(rid, t) is not None for rid, t in (("resp_a1", "a"), ("resp_b0", "b"), ("resp_c0", "c")))
    with pytest.raises(ValueError):
        ResponseStore(tenant_bytes=0)


def gateway_store(*flags: str) -> ResponseStore:
    argv = ["--worker", "http://127.0.0.1:1", "--model", "smollm2-135m", *flags]
    gw = build(parser().parse_args(argv))
    assert gw.responses.local is not None
    return gw.responses.local.store


def test_the_flags_bound_the_gateways_store_and_ledger():
    """An empty store or ledger is falsy (it has a length): the gateway once took its flags' empty
    ledger for none given and bounded it by the defaults."""
    argv = ["--worker", "http://127.0.0.1:1", "--model", "smollm2-135m", "--response-ids", "7"]
    gw = build(parser().parse_args([*argv, "--response-ttl-s", "30", "--response-store-mb", "2"]))
    store = gw.responses.local.store if gw.responses.local is not None else None
    assert (gw.responses.ids.size, gw.responses.ids.ttl_s) == (7, 30.0)
    assert store is not None and (store.size, store.ttl_s, store.max_bytes) == (7, 30.0, 2 << 20)
    assert (store.tenant_size, store.tenant_bytes) == (7, 2 << 20)  # without API keys: one tenant, all of it
    store = gateway_store("--response-ids", "8", "--response-store-mb", "4", "--api-key", "sk-a", "--api-key", "sk-b")
    assert (store.tenant_size, store.tenant_bytes) == (2, 1 << 20)  # with them: a quarter each
    store = gateway_store("--response-store-ids-per-tenant", "5", "--response-store-mb-per-tenant", "0.5")
    assert (store.tenant_size, store.tenant_bytes) == (5, 1 << 19)


def test_with_api_keys_one_tenants_responses_do_not_evict_anothers():
    store = gateway_store("--response-ids", "8", "--api-key", "sk-a", "--api-key", "sk-b")
    store.put(record("resp_b", "b"))
    for i in range(10):
        store.put(record(f"resp_a{i}", "a"))
    assert asyncio.run(store.find("resp_b", "b")) is not None


@pytest.mark.parametrize("flag", ["--response-store-mb", "--response-store-mb-per-tenant"])
@pytest.mark.parametrize("mb", ["inf", "nan", "-1", "0"])
def test_a_store_bound_that_is_not_a_finite_positive_size_is_a_clean_exit(flag, mb):
    argv = ["--worker", "http://127.0.0.1:1", "--model", "smollm2-135m", flag, mb]
    with pytest.raises(SystemExit) as e:
        build(parser().parse_args(argv))
    assert flag in str(e.value.code)


def test_another_tenants_id_held_here_is_asked_of_redis_as_an_unknown_one_is():
    """Redis not answering, both fail alike (a 503 upstream): a miss for one against a failure
    for the other would tell a client which ids exist."""
    store = ResponseStore(shared=SharedResponseStore("redis://127.0.0.1:1", "fleet-secret"))  # nothing listens
    store.remember(record("resp_a"), 60.0)
    assert asyncio.run(store.find("resp_a", "a")) == record("resp_a")  # its own tenant's: no need to ask
    for rid in ("resp_a", "resp_unknown"):
        with pytest.raises(LookupFailed):
            asyncio.run(store.find(rid, "b"))
