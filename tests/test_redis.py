"""Residency, registry and shared load through a test-started redis-server (never port 6379)."""

import asyncio
import json
import random
import time

import httpx
import pytest
import redis

from bench.redis_bootstrap import bootstrap_s, populate
from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.procs import Worker, start_gateway, start_redis, stop_all, wait_for, wait_redis
from gateway.redis_state import RedisState
from workers.kv import redis_schema as rs

MODEL = "smollm2-135m"
WORDS = "cache block token worker gateway prefix decode prefill route fleet queue page hash".split()

pytestmark = pytest.mark.slow


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """redis-server, four sim workers publishing to it, two gateway replicas discovering them
    there (no --worker flags)."""
    logs = str(tmp_path_factory.mktemp("redis"))
    server = wait_redis(start_redis(log_dir=logs))
    url = f"redis://127.0.0.1:{server.port}/0"
    workers = [Worker(worker_id=f"r{i}", redis=url, log_dir=logs) for i in range(4)]
    gateways = [
        start_gateway([], "prefix_affinity", redis=url, name=f"replica-{c}", log_dir=logs, extra=["--replica-id", c])
        for c in "ab"
    ]
    box: dict = {}
    try:
        for p in workers:
            p.ready()
        for g in gateways:
            g.wait_ready("/v1/models")
            g.wait_healthy(4, timeout=20, what="4 workers discovered through redis")
        box = {"redis": server, "url": url, "workers": workers, "gateways": gateways, "logs": logs}
        yield box
    finally:
        stop_all(gateways + workers + [box.get("redis", server)])


def complete(url: str, prompt: str, max_tokens: int = 2, stream: bool = False) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream},
    )


def test_worker_publishes_its_set_events_and_heartbeat(cluster):
    r = redis.Redis(port=cluster["redis"].port)
    w = cluster["workers"][0]
    httpx.post(w.url + "/v1/completions", json={"model": MODEL, "prompt": text(random.Random(5), 120), "max_tokens": 2})
    snap = w.internal("/kv/snapshot").json()

    def published():
        seq = r.get(rs.seq_key(MODEL, w.worker_id))
        return seq is not None and int(seq) == snap["seq"]

    wait_for(published, timeout=30, what="the worker's seq in redis")
    assert {int(h) for h in r.smembers(rs.resident_key(MODEL, w.worker_id))} == set(snap["hashes"])
    beat = json.loads(r.get(rs.heartbeat_key(MODEL, w.worker_id)))
    assert beat["url"] == w.url and beat["state"]["worker_id"] == w.worker_id
    assert 0 < r.pttl(rs.heartbeat_key(MODEL, w.worker_id)) <= 3000
    entries = [rs.decode_events(f) for _, f in r.xrange(rs.stream_key(MODEL))]
    mine = [ev for wid, evs in entries if wid == w.worker_id for ev in evs]
    assert mine[0].kind == rs.SNAPSHOT and any(ev.kind == "stored" for ev in mine)
    stored = {h for ev in mine if ev.kind == "stored" for h in ev.hashes}
    assert set(snap["hashes"]) <= stored


def test_two_replicas_choose_the_same_worker(cluster):
    a, b = (g.url for g in cluster["gateways"])
    rng = random.Random(9)
    docs = [text(rng, 200) for _ in range(6)]
    for d in docs:
        assert complete(a, d + " warm").status_code == 200
    wait_for(
        lambda: int(complete(b, docs[-1] + " probe").headers["x-kvgate-predicted-cached-tokens"]) > 0,
        timeout=30,
        what="replica b to see residency that replica a caused",
    )
    probes = [d + f" question {i}" for i, d in enumerate(docs)] + [text(rng, 150) for _ in range(4)]
    chosen = []
    for p in probes:
        pair = []
        for u in (a, b):  # one after the other: at once, b would see a's decision and spread
            time.sleep(0.6)  # both replicas' last /state polls show the fleet idle
            r = complete(u, p)
            assert r.status_code == 200
            pair.append(r.headers["x-kvgate-worker"])
        chosen.append(tuple(pair))
    assert all(x == y for x, y in chosen), chosen
    assert len({x for x, _ in chosen}) >= 2, "the probes spread over the fleet"


def test_in_flight_counts_and_ledgers_are_shared_between_replicas(cluster):
    """A request streaming through replica a counts at b, and sits in b's ledger of its worker."""
    a, b = (g.url for g in cluster["gateways"])
    with httpx.stream(
        "POST",
        a + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "long", "max_tokens": 600, "stream": True},
    ) as r:
        wid = r.headers["x-kvgate-worker"]
        lines = [
            f'kvgate_gateway_{m}{{model="{MODEL}",worker="{wid}"}} 1.0' for m in ("shared_in_flight", "ledger_requests")
        ]
        wait_for(
            lambda: all(x in httpx.get(b + "/metrics").text for x in lines), timeout=30, what="b to see a's request"
        )
    wait_for(
        lambda: all(x.replace("1.0", "0.0") in httpx.get(b + "/metrics").text for x in lines),
        timeout=30,
        what="b to see it finish",
    )


def test_a_decision_reaches_the_other_replica_before_the_next_table(tmp_path):
    """Two replicas' shared state over one redis-server, tables written only every 30 s: each
    +1 and -1 still reaches the other replica within a pub/sub round trip, so a burst split
    over replicas is seen as one (tables alone left each replica blind to the other's burst:
    10/2/2/2 on four workers where one replica spread 6/6/2/2)."""
    proc = wait_redis(start_redis(log_dir=str(tmp_path)))
    url = f"redis://127.0.0.1:{proc.port}/0"

    async def scenario() -> list[tuple[int, int]]:
        replicas = []
        for name in "ab":
            fleet = Fleet(ResidencyIndex())
            for i in range(4):
                fleet.add(f"http://127.0.0.1:1/{i}").worker_id = f"w{i}"
            replicas.append((fleet, RedisState(url, fleet, "secret", replica_id=name, inflight_interval=30.0)))
        for _, state in replicas:
            await state.start()
        (fa, sa), (fb, sb) = replicas
        try:
            await wait_async(lambda: sa.up and sb.up and fa.on_change and fb.on_change)
            await asyncio.sleep(0.3)  # both subscribed; the first tables are written
            wa, wb = fa.by_id("w0"), fb.by_id("w0")
            seen = []
            for _ in range(3):
                fa.begin(wa)
            fb.begin(fb.by_id("w1"))
            await wait_async(lambda: wb.shared_in_flight == 3 and fa.by_id("w1").shared_in_flight == 1)
            seen.append((wb.shared_in_flight, fa.by_id("w1").shared_in_flight))
            fa.end(wa)
            await wait_async(lambda: wb.shared_in_flight == 2)
            seen.append((wb.shared_in_flight, wa.shared_in_flight))
            return seen
        finally:
            for _, state in replicas:
                await state.stop()

    try:
        assert asyncio.run(scenario()) == [(3, 1), (2, 0)]
    finally:
        proc.stop()


async def wait_async(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.005)


def test_restarted_replica_rebuilds_100k_resident_blocks(tmp_path):
    """Every resident block and seq comes back (how fast: `python -m bench.redis_bootstrap`)."""
    proc = wait_redis(start_redis(log_dir=str(tmp_path)))
    try:
        client = redis.Redis(port=proc.port)
        populate(client, 100_000, 8)
        _, index = asyncio.run(bootstrap_s(f"redis://127.0.0.1:{proc.port}/0"))
        assert index.num_blocks() == 100_000 and index.seq("big3") == 1003
    finally:
        proc.stop()


def test_redis_outage_degrades_to_the_embedded_path_and_recovers(cluster):
    a = cluster["gateways"][0].url
    rng = random.Random(21)
    cluster["redis"].kill()
    wait_for(lambda: httpx.get(a + "/health").json()["redis"] == "down", timeout=30, what="a to notice")
    assert httpx.get(a + "/health").json()["healthy"] == 4, "workers found through redis stay"
    doc = text(rng, 200)
    first = complete(a, doc + " one")
    assert first.status_code == 200

    def predicted():
        r = complete(a, doc + f" again {rng.random()}")
        assert r.status_code == 200
        return int(r.headers["x-kvgate-predicted-cached-tokens"]) > 0 and r

    again = wait_for(predicted, timeout=30, interval=0.2, what="residency via /kv/events")
    assert again.headers["x-kvgate-worker"] == first.headers["x-kvgate-worker"]
    cluster["redis"] = start_redis(cluster["redis"].port, log_dir=cluster["logs"])
    wait_redis(cluster["redis"])
    wait_for(lambda: httpx.get(a + "/health").json()["redis"] == "up", timeout=10, what="a to reconnect")
    r = redis.Redis(port=cluster["redis"].port)
    wid = first.headers["x-kvgate-worker"]
    wait_for(lambda: r.scard(rs.resident_key(MODEL, wid)) > 0, timeout=10, what="the worker to resync its set")
    doc2 = text(rng, 200)
    complete(a, doc2 + " one")
    wait_for(
        lambda: int(complete(a, doc2 + f" {rng.random()}").headers["x-kvgate-predicted-cached-tokens"]) > 0,
        timeout=30,
        interval=0.2,
        what="residency via redis again",
    )
