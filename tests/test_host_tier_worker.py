"""A worker started with --host-kv-gb (sim executor, a test-started redis-server): evicted blocks
show in its host tier, in /state, /kv/snapshot and Redis' per-tier set, and a prompt whose blocks
were evicted is a cache hit again; a gateway's fleet predicts its copy backs on the rate it
publishes in /state, not on the gateway's own --host-kv-gbps."""

import asyncio
import random

import httpx
import redis

from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.procs import Worker, start_redis, stop_all, wait_for, wait_redis
from policies.api import TierCredits
from workers.kv import redis_schema as rs
from workers.kv.events import HOST

MODEL = "smollm2-135m"
WORDS = "cache block token worker gateway prefix decode prefill route fleet queue page hash".split()


def complete(url: str, prompt: str) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    r.raise_for_status()
    return r.json()


async def polled_rates(w: Worker) -> tuple[float, float]:
    """The host and disk rates a gateway's fleet (its fallback 50 GB/s host) gives `w`'s view."""
    fleet = Fleet(ResidencyIndex(), interval=0.1, token=w.token, tier_credits=TierCredits(host_gbps=50.0))
    fw = fleet.add(w.url)
    await fleet.start()
    try:
        async with asyncio.timeout(30):
            while not fw.available:
                await asyncio.sleep(0.05)
        credits = fleet.views([fw], {})[0].tier_credits
        return credits.host_gbps, credits.disk_gbps
    finally:
        await fleet.stop()


def test_a_worker_spills_to_host_publishes_both_tiers_and_hits_from_host(tmp_path):
    logs = str(tmp_path)
    server = wait_redis(start_redis(log_dir=logs))
    url = f"redis://127.0.0.1:{server.port}/0"
    w = Worker(
        worker_id="t0",
        redis=url,
        log_dir=logs,
        extra=["--num-blocks", "24", "--host-kv-gb", "0.05", "--host-kv-gbps", "3"],
    )
    try:
        w.ready()
        rng = random.Random(1)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(150)) for _ in range(4)]
        for p in prompts:
            complete(w.url, p)
        state = w.state()
        assert (
            state["host_blocks"] == int(0.05 * 2**30) // (16 * 36864)
            and state["host_free_blocks"] < state["host_blocks"]
        )
        snap = w.internal("/kv/snapshot").json()
        assert snap["tiers"][HOST], "the first prompts' blocks were evicted into the host tier"
        r = redis.Redis(port=server.port)
        wait_for(
            lambda: int(r.get(rs.seq_key(MODEL, "t0")) or 0) == snap["seq"],
            timeout=30,
            what="the worker's events in redis",
        )
        assert {int(h) for h in r.smembers(rs.resident_key(MODEL, "t0", HOST))} == set(snap["tiers"][HOST])
        assert {int(h) for h in r.smembers(rs.resident_key(MODEL, "t0"))} == set(snap["hashes"])
        again = complete(w.url, prompts[0])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 8
        back = set(w.internal("/kv/snapshot").json()["hashes"]) & set(snap["tiers"][HOST])
        assert len(back) >= 8, "the hit's blocks came back from the host tier onto the device"
        assert (state["host_gbps"], state["load_every_hit"]) == (3.0, False)
        assert asyncio.run(polled_rates(w)) == (3.0, TierCredits().disk_gbps)
    finally:
        stop_all([w, server])
