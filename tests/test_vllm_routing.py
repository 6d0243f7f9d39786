"""What the gateway's router knows of a vLLM server (tests/fake_vllm.py behind a real gateway,
tests/fake_vllm_gateway.py): its residency from its ZMQ events (or through a bridge's Redis),
dropped on a restart or while it is unhealthy until resynced, never a decision waiting on ZMQ
or HTTP, and whether it has a cost model."""

from pathlib import Path

import httpx

from tests import vllm_data as vd
from tests.fake_vllm_gateway import (
    PROMPT,
    control,
    fake,  # noqa: F401 (a fixture)
    gateway,
)
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

PROFILE = Path(__file__).parent.parent / "bench" / "profiles" / "vllm-cpu-smollm2-135m.json"


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
