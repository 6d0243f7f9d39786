"""Redis killed and restarted under traffic: the gateway keeps serving, with 0 failed requests.

Real redis-server (a private one on a free port), real gateway and sim workers that know each
other only through Redis. A restarted Redis is empty until the workers re-register; the gateway
must keep routing to the workers it knew rather than re-bootstrap to an empty registry.
"""

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import redis

from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.redis_state import RedisState
from gateway.procs import TEST_TOKEN, Worker, start_gateway, start_redis, stop_all, wait_for, wait_redis
from workers.kv import redis_schema as rs

MODEL = "smollm2-135m"
WORDS = "cache block token worker gateway prefix decode prefill route fleet queue page hash".split()

pytestmark = pytest.mark.slow


class Traffic:
    """Clients in threads sending short completions until stopped; every answer is recorded."""

    def __init__(self, url: str, clients: int = 3):
        self.url = url
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _client(self, i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                prompt = " ".join(rng.choice(WORDS) for _ in range(40))
                try:
                    r = c.post(self.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failures.append(f"{time.monotonic():.2f} {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.failures.append(f"{time.monotonic():.2f} {e!r}")


def redis_up(url: str) -> float:
    """The gateway's `kvgate_gateway_redis_up`, what an operator's alert reads."""
    text = httpx.get(url + "/metrics").text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("kvgate_gateway_redis_up "))


def test_redis_killed_and_restarted_under_traffic_fails_no_request(tmp_path):
    logs = str(tmp_path)
    server = wait_redis(start_redis(log_dir=logs))
    port = server.port
    url = f"redis://127.0.0.1:{port}/0"
    workers = [Worker(worker_id=f"rr{i}", redis=url, log_dir=logs) for i in range(2)]
    gateway = start_gateway([], "round_robin", redis=url, name="gateway", log_dir=logs)
    procs = [gateway, *workers]
    try:
        for w in workers:
            w.ready()
        gateway.wait_ready("/v1/models")
        gateway.wait_healthy(2, timeout=20, what="2 workers discovered through redis")
        with Traffic(gateway.url) as traffic:
            wait_for(lambda: traffic.ok >= 20, timeout=30, what="traffic before the outage")
            for _ in range(2):
                server.kill()
                wait_for(
                    lambda: httpx.get(gateway.url + "/health").json()["redis"] == "down",
                    timeout=10,
                    what="the gateway to notice the outage",
                )
                assert redis_up(gateway.url) == 0.0
                before = traffic.ok
                wait_for(lambda: traffic.ok >= before + 10, timeout=30, what="traffic during the outage")
                server = wait_redis(start_redis(port, log_dir=logs))
                wait_for(
                    lambda: httpx.get(gateway.url + "/health").json()["redis"] == "up",
                    timeout=15,
                    what="the gateway to reconnect",
                )
                assert redis_up(gateway.url) == 1.0
                r = redis.Redis(port=port)
                wait_for(lambda: r.scard(rs.workers_key(MODEL)) == 2, timeout=15, what="the workers to re-register")
                before = traffic.ok
                wait_for(lambda: traffic.ok >= before + 20, timeout=30, what="traffic after the restart")
        print(f"redis killed and restarted twice under traffic: {traffic.ok} ok, {len(traffic.failures)} failed")
        assert traffic.failures == [], (
            f"{len(traffic.failures)} failed of {traffic.ok + len(traffic.failures)}: {traffic.failures[:5]}"
        )
        assert gateway.healthy() == 2
    finally:
        stop_all(procs + [server])


def test_a_known_worker_is_kept_through_an_empty_registry_only_for_the_grace(tmp_path):
    """A restarted (empty) Redis keeps the fleet for `grace_s`; a worker that has not
    re-registered by then leaves, and one that re-registers stays."""
    server = wait_redis(start_redis(log_dir=str(tmp_path)))
    r = redis.Redis(port=server.port)

    def register(wid: str) -> None:
        reg = rs.Registration(wid, f"http://127.0.0.1:1/{wid}", MODEL, time.time()).signed(TEST_TOKEN)
        r.set(rs.heartbeat_key(MODEL, wid), json.dumps(reg.to_json()), px=60_000)
        r.sadd(rs.workers_key(MODEL), wid)
        r.sadd(rs.POOLS, MODEL)

    async def run() -> list[set[str]]:
        fleet = Fleet(ResidencyIndex())
        state = RedisState(f"redis://127.0.0.1:{server.port}/0", fleet, TEST_TOKEN, grace_s=0.3)
        client = state.client()
        urls = []
        try:
            await state.refresh_registry(client)
            urls.append(set(fleet.workers))
            r.flushall()  # what a restarted Redis looks like
            state.grace_until = time.monotonic() + state.grace_s
            await state.refresh_registry(client)
            urls.append(set(fleet.workers))
            register("back")
            await asyncio.sleep(0.4)
            await state.refresh_registry(client)
            urls.append(set(fleet.workers))
        finally:
            await client.aclose()
        return urls

    try:
        register("gone")
        register("back")
        before, during, after = asyncio.run(run())
    finally:
        server.stop()
    both = {"http://127.0.0.1:1/gone", "http://127.0.0.1:1/back"}
    assert before == both and during == both, "the empty registry dropped known workers"
    assert after == {"http://127.0.0.1:1/back"}, "a worker that never re-registered stayed past the grace"
