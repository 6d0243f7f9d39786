"""A real gateway in front of a fake vLLM server (tests/fake_vllm.py): residency from its ZMQ
events, load and restarts from its /metrics, health from /health, whole requests forwarded
byte for byte, and no routing decision ever waiting on ZMQ or HTTP."""

import json
import sys
from pathlib import Path

import httpx
import pytest

from tests import vllm_data as vd
from gateway.procs import (
    KVGATE,
    TEST_TOKEN,
    Proc,
    free_port,
    start_gateway,
    start_redis,
    stop_all,
    wait_for,
    wait_redis,
)
from workers.model_store import load_tokenizer

PROMPT = " ".join(f"word{i}" for i in range(60))
PROFILE = Path(__file__).parent.parent / "bench" / "profiles" / "vllm-cpu-smollm2-135m.json"


@pytest.fixture
def fake(tmp_path):
    port = free_port()
    proc = Proc(
        "fake-vllm",
        [
            sys.executable,
            "-m",
            "tests.fake_vllm",
            "--port",
            str(port),
            "--events-port",
            str(free_port()),
            "--replay-port",
            str(free_port()),
        ],
        port,
        str(tmp_path),
    )
    try:
        yield proc.wait_ready("/health", 60)
    finally:
        proc.stop()


def control(fake: Proc, **body) -> dict:
    return httpx.post(fake.url + "/_control", json=body, timeout=10).json()


def gateway(fake: Proc, tmp_path, policy: str = "prefix_affinity", extra: tuple = ()) -> Proc:
    tmp_path.mkdir(parents=True, exist_ok=True)
    gw = start_gateway([f"vllm:{fake.url}"], policy, extra=list(extra), log_dir=str(tmp_path))
    gw.wait_ready(timeout=60)
    gw.wait_healthy(1, 30, what="the fake vLLM up")
    return gw


def blocks(n: int) -> list[dict]:
    """BlockStored events for PROMPT's first n engine blocks (32 tokens each), one per batch."""
    ids = load_tokenizer(vd.MODEL).encode(PROMPT)
    assert len(ids) > 32 * n
    return [[vd.stored([100 + i], ids[32 * i : 32 * (i + 1)], parent=100 + i - 1 if i else None)] for i in range(n)]


def predicted(gw: Proc, body: dict | None = None) -> int:
    r = httpx.post(
        gw.url + "/v1/completions", json=body or {"model": vd.MODEL, "prompt": PROMPT, "max_tokens": 1}, timeout=30
    )
    assert r.status_code == 200, r.text
    return int(r.headers["x-kvgate-predicted-cached-tokens"])


def test_residency_follows_the_events_and_a_restart_drops_it_until_resynced(fake, tmp_path):
    gw = gateway(fake, tmp_path, extra=("--internal-token", "fleet-secret"))
    try:
        control(fake, publish=blocks(2))
        wait_for(lambda: predicted(gw) == 64, 30, what="the stored blocks in the index")
        assert gw.metric("kvgate_gateway_resident_blocks") == 4  # 2 vLLM blocks = 4 of the gateway's
        control(fake, restart=True)  # process_start_time_seconds changes, numbering starts again
        wait_for(lambda: predicted(gw) == 0, 30, what="the restarted server's residency dropped")
        control(fake, publish=blocks(1))
        wait_for(lambda: predicted(gw) == 32, 30, what="the new process's events followed")
        assert gw.metric("kvgate_gateway_vllm_event_resyncs_total") >= 2
        assert control(fake)["saw_token"] is False  # the fleet's secret is for kvgate's workers only
    finally:
        gw.stop()


def test_a_server_error_is_the_workers_failure_never_the_clients_answer(fake, tmp_path):
    """A 500 (or 502, 504) is tried elsewhere; with nowhere left the client gets the gateway's
    OpenAI-shaped 502, not the worker's own error. A 503 is load: the worker's answer stands."""
    gw = gateway(fake, tmp_path, extra=("--max-retries", "2", "--breaker-failures", "100"))
    try:
        body = {"model": vd.MODEL, "prompt": PROMPT, "max_tokens": 1}
        for status in (500, 502, 504):
            control(fake, answer=status)
            r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == "worker_failed" and r.json()["error"]["type"] == "server_error"
        assert gw.metric("kvgate_gateway_upstream_failures_total", stage="response") == 3
        control(fake, answer=503)
        assert httpx.post(gw.url + "/v1/completions", json=body, timeout=30).status_code == 503
        control(fake, answer=200)
        assert httpx.post(gw.url + "/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        gw.stop()


def test_an_unhealthy_server_is_out_with_its_residency_and_comes_back_resynced(fake, tmp_path):
    gw = gateway(fake, tmp_path)
    try:
        control(fake, publish=blocks(2))
        wait_for(lambda: predicted(gw) == 64, 30, what="the stored blocks in the index")
        control(fake, health=503)
        gw.wait_healthy(0, 30, what="the server out")
        assert gw.metric("kvgate_gateway_resident_blocks") == 0
        control(fake, health=200)
        gw.wait_healthy(1, 30, what="the server back")
        wait_for(lambda: predicted(gw) == 64, 30, what="its residency replayed")
    finally:
        gw.stop()


def test_no_decision_waits_on_a_replay_that_never_answers(fake, tmp_path):
    control(fake, replay="stuck", publish=blocks(2))
    gw = gateway(fake, tmp_path)
    try:
        for i in range(5):  # routed cache-blind at once while the subscriber waits for its replay
            # (distinct prompts: the router remembers what it just sent, which is not the index)
            assert predicted(gw, {"model": vd.MODEL, "prompt": f"{i} {PROMPT}", "max_tokens": 1}) == 0
        assert gw.metric("kvgate_gateway_vllm_event_batches_total") == 0
        control(fake, replay="ok")
        wait_for(lambda: predicted(gw) == 64, 60, what="the replay once it answers")
    finally:
        gw.stop()


def test_whole_requests_reach_vllm_byte_for_byte(fake, tmp_path):
    gw = gateway(fake, tmp_path)
    try:
        raw = json.dumps(
            {
                "model": vd.MODEL,
                "prompt": ["a b c", "d e"],
                "n": 2,
                "logprobs": 3,
                "max_tokens": 4,
                "presence_penalty": 0.1,
                "vllm_xargs": {"custom": 1},
            }
        ).encode()
        r = httpx.post(gw.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["received"].encode() == raw
    finally:
        gw.stop()


def test_slo_goodput_says_when_a_vllm_worker_has_no_cost_model(fake, tmp_path):
    gw = gateway(fake, tmp_path / "none", "slo_goodput")
    try:
        assert predicted(gw) == 0
        wait_for(lambda: "has no cost model" in gw.log_tail(20_000), 10, what="the warning")
    finally:
        gw.stop()
    gw = gateway(fake, tmp_path / "calibrated", "slo_goodput", ("--vllm-profile", str(PROFILE)))
    try:
        assert predicted(gw) == 0 and "has no cost model" not in gw.log_tail(20_000)
    finally:
        gw.stop()


def test_a_gateway_block_size_that_does_not_divide_vllms_routes_cache_blind_and_says_so(fake, tmp_path):
    gw = gateway(fake, tmp_path, extra=("--block-size", "64"))
    try:
        control(fake, publish=blocks(2))
        wait_for(lambda: gw.metric("kvgate_gateway_vllm_event_batches_total") == 2, 30, what="the batches")
        assert predicted(gw) == 0 and gw.metric("kvgate_gateway_resident_blocks") == 0
        assert "which the gateway's --block-size 64 does not divide" in gw.log_tail(20_000)
    finally:
        gw.stop()


def test_through_a_bridge_a_restart_empties_the_residency_in_redis_until_resynced(fake, tmp_path):
    redis = start_redis(log_dir=str(tmp_path))
    procs = [redis]
    try:
        wait_redis(redis)
        url = f"redis://127.0.0.1:{redis.port}"
        procs.append(
            Proc(
                "bridge",
                KVGATE + ["bridge", "--vllm", fake.url, "--redis", url],
                free_port(),
                str(tmp_path),
                {"KVGATE_INTERNAL_TOKEN": TEST_TOKEN},
            )
        )
        gw = start_gateway([], "prefix_affinity", redis=url, log_dir=str(tmp_path))
        procs.append(gw)
        gw.wait_ready(timeout=60)
        gw.wait_healthy(1, 30, what="the server via redis")
        control(fake, publish=blocks(2))
        wait_for(lambda: predicted(gw) == 64, 30, what="the residency through redis")
        control(fake, restart=True)
        wait_for(lambda: predicted(gw) == 0, 30, what="the restarted server's set emptied")
        control(fake, publish=blocks(1))
        wait_for(lambda: predicted(gw) == 32, 30, what="the new process's events through redis")
        assert gw.metric("kvgate_gateway_vllm_event_batches_total") == 0  # none over ZMQ
    finally:
        stop_all(procs)
