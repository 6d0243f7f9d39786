"""P/D over NIXL between real worker processes on loopback (UCX over TCP and shared memory).

Through the gateway with `--kv-transport nixl` on both workers: greedy output equals a mixed
worker's, the blocks arrive by NIXL (the decode worker's HTTP import stays unused), the prefill
worker found the decode worker's agent metadata in Redis (its signed record lives as long as the
worker, and a restarted worker's new agent is looked up afresh), a prompt
longer than one prefill step is shipped in batches, no blocks leak on either side, and a
prefill worker killed mid-WRITE leaves the decode worker recomputing (the fallback), with
its reservation quarantined (a WRITE might still land) for the configured bound and then let
go, not hanging.
"""

import json
import sys

import httpx
import pytest
import redis

from bench.export_overlap import SPAN_FLUSH_MS, traced_leg
from gateway.procs import Proc, Worker, free_port, start_gateway, start_redis, stop_all, wait_for, wait_redis
from tests.nixl_fault_worker import DIE_ENV
from workers.kv import redis_schema as rs
from tests.test_gateway_pd import ask, prompt
from tests.test_metrics import samples
from workers.transfer import KVSpec, encode_header
from workers.nixl_agent import nixl_module

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(nixl_module() is None, reason="NIXL is not installed: pip install 'kvgate[nixl]'"),
]
SECRET = ("--internal-token", "nixl-pd-token")
NIXL = ("--kv-transport", "nixl")
QUARANTINE = ("--nixl-quarantine-s", "3")
PD = ("--pd-min-uncached-tokens", "64", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000")


def drained(w) -> bool:
    s = w.state()
    return s["running"] == s["waiting"] == s["pending_kv"] == 0 and s["free_blocks"] == s["total_blocks"]


@pytest.fixture(scope="module")
def nixl_fleet(tiny_llama, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("nixl"))
    model = str(tiny_llama)
    server = wait_redis(start_redis(log_dir=logs))
    batches = ("--max-batched-tokens", "64", "--kv-export-batch-blocks", "4")  # a batch of 4 blocks a step
    url = f"redis://127.0.0.1:{server.port}/0"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", SPAN_FLUSH_MS)
        traced = ("--trace", "console")  # its spans show when its exports began
        extra = ("--role", "prefill", *batches, *traced, *SECRET, *NIXL)
        p = Worker("torch", "nx-p", extra=extra, model=model, log_dir=logs, redis=url)
    d = Worker(
        "torch", "nx-d", extra=("--role", "decode", *SECRET, *NIXL, *QUARANTINE), model=model, log_dir=logs, redis=url
    )
    m = Worker("torch", "nx-m", extra=SECRET, model=model, log_dir=logs)
    gw = start_gateway([p.url, d.url], "slo_goodput", log_dir=logs, extra=[*SECRET, "--model", model, *PD])
    try:
        for w in (p, d, m):
            w.ready()
        gw.wait_ready("/v1/models")
        gw.wait_healthy(2, what="2 workers")
        yield {"p": p, "d": d, "m": m, "gw": gw, "model": tiny_llama.name, "redis": server, "redis_url": url}
    finally:
        stop_all([gw, p, d, m, server])


def test_workers_publish_their_nixl_agent(nixl_fleet):
    d = nixl_fleet["d"]
    assert httpx.get(d.url + "/kv/nixl").status_code == 403, "agent metadata is internal"
    info = d.internal("/kv/nixl").json()
    state = d.state()["kv_transfer"]
    assert state["transport"] == "nixl" and state["nixl"]["layout"] == info
    assert info["mem"] == "DRAM" and info["num_slices"] == 2 * 2 and info["metadata"]
    r = redis.Redis(port=nixl_fleet["redis"].port)
    beat = wait_for(lambda: r.get(rs.heartbeat_key(nixl_fleet["model"], "nx-d")), what="a heartbeat in redis")
    reg = rs.Registration.from_json(json.loads(beat))
    assert reg.why_invalid(SECRET[1]) is None and reg.state["kv_transfer"]["nixl"]["layout"] == info
    rec = rs.AgentRecord.from_json(json.loads(r.get(rs.nixl_key(nixl_fleet["model"], info["agent"]))))
    assert rec.why_invalid(SECRET[1]) is None and rec.worker_id == "nx-d" and rec.layout == info
    assert 0 < r.pttl(rs.nixl_key(nixl_fleet["model"], info["agent"])) <= 3000, "it expires like the heartbeat"


def test_reservations_refuse_strangers_and_bad_transfers(nixl_fleet):
    d = nixl_fleet["d"]
    token = {"x-kvgate-token": SECRET[1]}
    assert httpx.post(d.url + "/kv/nixl/reserve", content=b"KVG1").status_code == 403
    assert httpx.post(d.url + "/kv/nixl/commit", json={"id": "x", "ok": True}).status_code == 403
    r = httpx.post(d.url + "/kv/nixl/reserve", content=b"nope", headers=token)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_kv_transfer"
    spec = KVSpec(nixl_fleet["model"], 16, "float32", 2, 2, 16)
    forged = encode_header(spec, [1, 2], [list(range(16)), list(range(16, 32))], None)
    r = httpx.post(d.url + "/kv/nixl/reserve", content=forged, headers=token)
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_hash_mismatch", r.text
    assert httpx.post(d.url + "/kv/nixl/commit", json={"id": "unknown", "ok": True}, headers=token).status_code == 409
    assert httpx.post(d.url + "/kv/nixl/commit", json={"id": 3, "ok": "yes"}, headers=token).status_code == 400
    assert d.state()["kv_transfer"]["nixl"]["reservations"] == 0


def test_pd_over_nixl_equals_a_mixed_worker_and_leaks_nothing(nixl_fleet):
    f = nixl_fleet
    before = f["d"].state()
    for n, stream in ((200, False), (333, True)):
        ids = prompt(n, n + 5)
        _, want, _ = ask(f["m"].url, f["model"], ids)
        headers, got, cached = ask(f["gw"].url, f["model"], ids, stream=stream)
        assert headers["x-kvgate-prefill-worker"] == "nx-p" and headers["x-kvgate-worker"] == "nx-d"
        assert got == want
        assert cached == (n - 1) // 16 * 16, "every full block but the last arrived"
    for w in (f["p"], f["d"]):
        wait_for(lambda: drained(w), what=f"{w.name} drained")
    p, d = f["p"].state()["kv_transfer"], f["d"].state()["kv_transfer"]
    assert p["sent_bytes"] > 0 and p["failures"] == 0 and p["nixl"]["fallbacks"] == 0
    assert p["sent_by_transport"]["nixl"]["bytes"] == p["sent_bytes"], "every byte went by NIXL"
    assert p["nixl"]["peer_lookups"]["redis"] == 1 and p["nixl"]["peer_lookups"]["http"] == 0, "metadata from redis"
    assert p["nixl"]["peer_lookups"]["cache"] == committed(d, before) - 1, "then from its own cache"
    text = httpx.get(f["p"].url + "/metrics").text
    assert samples(text, "kvgate_worker_nixl_peer_lookups_total", source="redis") == [1.0]
    assert samples(text, "kvgate_worker_kv_sent_bytes_total", transport="nixl") == [p["sent_bytes"]]
    assert samples(text, "kvgate_worker_kv_sent_bytes_total", transport="http") == [0.0]
    assert samples(text, "kvgate_worker_kv_export_backlog_bytes") == [0.0], "nothing left to send"
    assert d["received_seconds"] == before["kv_transfer"]["received_seconds"], "nothing came by HTTP"
    assert d["nixl"]["reservations"] == 0 and d["nixl"]["expired"] == 0
    assert committed(d, before) >= 199 // 64 + 332 // 64, (
        "blocks went in batches as 64-token prefill steps computed them"
    )


def committed(d: dict, before: dict) -> int:
    return d["nixl"]["committed"] - before["kv_transfer"]["nixl"]["committed"]


def test_the_first_batch_is_exported_before_the_prefill_ends(nixl_fleet):
    """Block-batch pipelining on real workers, read from the prefill worker's own spans: the
    first batch's `kv_export` begins before the last `prefill_chunk` completes."""
    f = nixl_fleet
    tl, _ = traced_leg(f["p"], f["d"], prompt(1000, 5))  # 16 steps of 64 tokens, a batch of 4 blocks each
    assert len(tl.chunks) == 16 and len(tl.exports) > 1
    assert tl.overlaps, (tl.exports[0], tl.chunks[-1])


def dying_worker(model, role: str, step: str, log_dir: str) -> Proc:
    """A worker SIGKILLed at `step` of its first NIXL transfer (tests/nixl_fault_worker.py)."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "tests.nixl_fault_worker",
        "--model",
        str(model),
        "--executor",
        "torch",
        "--port",
        str(port),
        "--worker-id",
        "nx-dying",
        "--role",
        role,
        *SECRET,
        *NIXL,
    ]
    return Proc("nx-dying", argv, port, log_dir, env={DIE_ENV: step})


def test_prefill_worker_dying_mid_transfer_falls_back_to_recompute(nixl_fleet, tiny_llama, tmp_path):
    f = nixl_fleet
    dying = dying_worker(tiny_llama, "prefill", "write", str(tmp_path))
    gw = start_gateway(
        [dying.url, f["d"].url],
        "slo_goodput",
        log_dir=str(tmp_path),
        name="gw-dying",
        extra=[*SECRET, "--model", str(tiny_llama), "--pd-wait-ms", "1500", *PD],
    )
    try:
        dying.wait_ready(timeout=180)
        gw.wait_ready("/v1/models")
        gw.wait_healthy(2, what="2 workers")
        ids = prompt(250, 99)
        _, want, _ = ask(f["m"].url, f["model"], ids)
        headers, got, cached = ask(gw.url, f["model"], ids)
        assert headers["x-kvgate-worker"] == "nx-d" and got == want and cached == 0
        assert not dying.alive, "the prefill worker died in its transfer"
        d = f["d"]
        expired = wait_for(lambda: (n := d.state()["kv_transfer"]["nixl"])["expired"] == 1 and n, timeout=30)
        assert expired["quarantined_blocks"] > 0, "the granted blocks are held: the WRITE may still land in them"
        assert expired["quarantine_releases"] == {"completed": 0, "timed_out": 0}
        nixl = wait_for(
            lambda: (n := d.state()["kv_transfer"]["nixl"])["quarantine_releases"]["timed_out"] == 1 and n,
            timeout=30,
            what="the quarantine's bound to pass",
        )
        assert nixl["quarantined"] == nixl["quarantined_blocks"] == 0
        wait_for(lambda: drained(d), what="decode worker drained")
        text = httpx.get(d.url + "/metrics").text
        assert samples(text, "kvgate_worker_kv_quarantine_releases_total", outcome="timed_out") == [1.0]
        assert samples(text, "kvgate_worker_kv_quarantined_blocks") == [0.0]
    finally:
        stop_all([gw, dying])


def test_decode_worker_dying_mid_transfer_leaves_the_prefill_worker_whole(nixl_fleet, tiny_llama, tmp_path):
    """The decode side dies when the commit comes: the prefill worker's export fails (NIXL, then
    the HTTP fallback), its blocks go back, and it serves on."""
    p = nixl_fleet["p"]
    dying = dying_worker(tiny_llama, "decode", "commit", str(tmp_path))
    try:
        dying.wait_ready(timeout=180)
        before = p.state()["kv_transfer"]
        leg = httpx.post(
            p.url + "/v1/completions",
            timeout=120,
            headers={"x-kvgate-token": SECRET[1]},
            json={
                "model": nixl_fleet["model"],
                "prompt": prompt(100, 3),
                "max_tokens": 1,
                "kv_transfer": {"export_to": dying.url},
            },
        )
        assert leg.status_code == 200, leg.text
        wait_for(lambda: not dying.alive, timeout=30, what="the decode worker died at the commit")
        wait_for(
            lambda: p.state()["kv_transfer"]["failures"] > before["failures"],
            timeout=60,
            what="the export counted as failed",
        )
        after = p.state()["kv_transfer"]
        assert after["nixl"]["fallbacks"] > before["nixl"]["fallbacks"]
        wait_for(lambda: drained(p), what="prefill worker drained")
        assert len(ask(p.url, nixl_fleet["model"], prompt(40, 1), max_tokens=3)[1]) == 3, "it serves on"
    finally:
        dying.stop()


def test_a_peer_without_nixl_gets_the_blocks_over_http(nixl_fleet):
    """An HTTP-only decode side (here the mixed worker) has no /kv/nixl: the export falls back
    to the HTTP stream, and later exports to it go there straight away."""
    p, m, model = nixl_fleet["p"], nixl_fleet["m"], nixl_fleet["model"]
    before = p.state()["kv_transfer"]
    for salt in (21, 22):
        leg = httpx.post(
            p.url + "/v1/completions",
            timeout=120,
            headers={"x-kvgate-token": SECRET[1]},
            json={"model": model, "prompt": prompt(80, salt), "max_tokens": 1, "kv_transfer": {"export_to": m.url}},
        )
        assert leg.status_code == 200, leg.text
        wait_for(
            lambda: ask(m.url, model, prompt(80, salt), max_tokens=1)[2] == 64,
            timeout=30,
            what="the blocks in the mixed worker's cache",
        )
    after = p.state()["kv_transfer"]
    sends = 2 * 2  # per prompt: 4 blocks after the first 64-token step, the fifth at its end
    assert after["failures"] == before["failures"] and after["nixl"]["fallbacks"] == before["nixl"]["fallbacks"] + sends
    assert m.state()["kv_transfer"]["received_seconds"]["body"] > 0


def export(p, url: str, model: str, ids: list[int]) -> None:
    """A prefill leg on `p` that exports its blocks to the decode worker at `url`."""
    leg = httpx.post(
        p.url + "/v1/completions",
        timeout=120,
        headers={"x-kvgate-token": SECRET[1]},
        json={"model": model, "prompt": ids, "max_tokens": 1, "kv_transfer": {"export_to": url}},
    )
    assert leg.status_code == 200, leg.text


def test_an_agent_record_lives_with_its_worker_and_a_restart_is_looked_up_afresh(nixl_fleet, tiny_llama, tmp_path):
    """A decode worker's record is in Redis while it runs and gone once it stopped; the same
    worker restarted (same id, same URL) runs a new agent, which the prefill worker looks up in
    Redis again rather than writing by the dead agent's metadata."""
    f, model = nixl_fleet, nixl_fleet["model"]
    r, port, agents = redis.Redis(port=f["redis"].port), free_port(), []
    for run in (1, 2):
        w = Worker(
            "torch",
            "nx-r",
            port=port,
            extra=("--role", "decode", *SECRET, *NIXL),
            model=str(tiny_llama),
            log_dir=str(tmp_path),
            redis=f["redis_url"],
        )
        try:
            w.ready()
            agent = w.state()["kv_transfer"]["nixl"]["agent"]
            key = rs.nixl_key(model, agent)
            wait_for(lambda: r.exists(key), what="the agent record in redis")
            before = f["p"].state()["kv_transfer"]["nixl"]["peer_lookups"]
            ids = prompt(80, 40 + run)
            export(f["p"], w.url, model, ids)
            wait_for(lambda: ask(w.url, model, ids, max_tokens=1)[2] == 64, timeout=30, what="the blocks arrived")
            after = f["p"].state()["kv_transfer"]["nixl"]["peer_lookups"]
            assert (after["redis"] - before["redis"], after["http"] - before["http"]) == (1, 0)
            assert w.state()["kv_transfer"]["nixl"]["committed"] >= 1, "they came by NIXL"
        finally:
            w.stop()
        assert not r.exists(key), "deregistered at shutdown"
        agents.append(agent)
    assert agents[0] != agents[1]
