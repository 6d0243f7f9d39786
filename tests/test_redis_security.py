"""Redis as a trust boundary: password + TLS URLs, and signed worker registrations.

One private redis-server that speaks only TLS and wants a password; a sim worker and a gateway
that meet there; and an "attacker" that can write to that Redis but lacks the fleet's internal
token: it registers its own worker (a sim worker standing in for a prompt-stealing server)
unsigned, badly signed, or with a legitimate registration's URL changed. None of them may
receive a prompt.
"""

import contextlib
import json
import re
import subprocess
import time

import httpx
import pytest
import redis

from gateway.procs import TEST_TOKEN, Worker, free_port, start_gateway, start_redis, stop_all, wait_for, wait_redis
from workers.kv import redis_schema as rs

MODEL = "smollm2-135m"
PASSWORD = "s3cret-redis-pw"

pytestmark = pytest.mark.slow


def make_cert(d) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA) and its key."""
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("redis-tls")
    logs = str(d)
    cert, key = make_cert(d)
    port = free_port()
    server = start_redis(
        port,
        logs,
        [
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            cert,
            "--tls-key-file",
            key,
            "--tls-ca-cert-file",
            cert,
            "--tls-auth-clients",
            "no",
            "--requirepass",
            PASSWORD,
        ],
    )
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    procs = [server]
    try:
        wait_redis(server, url=url)
        worker = Worker(worker_id="good", redis=url, log_dir=logs)
        evil = Worker(worker_id="evil", log_dir=logs)  # no Redis, no token: the attacker's server
        gateway = start_gateway([], "round_robin", redis=url, name="gateway", log_dir=logs)
        procs += [worker, evil, gateway]
        worker.ready()
        evil.ready()
        gateway.wait_ready("/v1/models")
        gateway.wait_healthy(1, timeout=20, what="the worker discovered through TLS redis")
        yield {"url": url, "worker": worker, "evil": evil, "gateway": gateway, "procs": procs}
    finally:
        stop_all(procs[1:] + procs[:1])


def client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2)


@contextlib.contextmanager
def registered(url: str, info: dict):
    """What anything that can write to Redis can do: put a heartbeat in the registry (removed after)."""
    r = client(url)
    r.set(rs.heartbeat_key(MODEL, info["worker_id"]), json.dumps(info), px=60_000)
    r.sadd(rs.workers_key(MODEL), info["worker_id"])
    r.sadd(rs.POOLS, MODEL)
    try:
        yield
    finally:
        r.delete(rs.heartbeat_key(MODEL, info["worker_id"]))


def requests_served(worker: Worker) -> float:
    text = httpx.get(worker.url + "/metrics").text
    m = re.search(r"^kvgate_worker_e2e_request_latency_seconds_count\S* (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def gateway_metric(cluster, name: str) -> float:
    text = httpx.get(cluster["gateway"].url + "/metrics").text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} is not exported"
    return float(m.group(1))


def assert_no_prompt_reaches(cluster, what: str) -> None:
    g = cluster["gateway"]
    time.sleep(1.5)  # three registry refreshes and /state polls: a forged worker would be up by now
    assert g.healthy() == 1, f"{what}: the forged worker joined"
    for i in range(8):
        r = httpx.post(
            g.url + "/v1/completions",
            timeout=30,
            json={"model": MODEL, "prompt": f"secret prompt {i}", "max_tokens": 2},
        )
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "good", (what, r.status_code, r.headers)
    assert requests_served(cluster["evil"]) == 0, f"{what}: the attacker's server got prompts"


def test_worker_and_gateway_meet_through_tls_redis_with_a_password(cluster):
    r = client(cluster["url"])
    beat = rs.Registration.from_json(json.loads(r.get(rs.heartbeat_key(MODEL, "good"))))
    assert beat.url == cluster["worker"].url and beat.why_invalid(TEST_TOKEN) is None
    resp = httpx.post(
        cluster["gateway"].url + "/v1/completions",
        timeout=30,
        json={"model": MODEL, "prompt": "hello over tls", "max_tokens": 2},
    )
    assert resp.status_code == 200
    for p in (cluster["gateway"], cluster["worker"]):
        assert PASSWORD not in p.log_path.read_text(errors="replace"), f"{p.name} logged the redis password"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(cluster["url"].replace(PASSWORD, "wrong"), socket_timeout=2).ping()


def test_unsigned_registration_gets_no_prompts(cluster):
    info = {"worker_id": "evil", "url": cluster["evil"].url, "pool": MODEL, "state": {}, "ts": time.time()}
    with registered(cluster["url"], info):
        assert_no_prompt_reaches(cluster, "unsigned")
        wait_for(
            lambda: "unsigned" in cluster["gateway"].log_tail(20000),
            timeout=30,
            what="the gateway to log the ignored registration",
        )
        assert gateway_metric(cluster, "kvgate_gateway_redis_rejected_registrations") == 1.0
    wait_for(
        lambda: gateway_metric(cluster, "kvgate_gateway_redis_rejected_registrations") == 0.0,
        timeout=30,
        what="the ignored registration to leave the gauge once it expires",
    )


def test_registration_signed_with_another_token_gets_no_prompts(cluster):
    forged = rs.Registration("evil", cluster["evil"].url, MODEL, time.time(), {}).signed("not-the-fleet-token")
    with registered(cluster["url"], forged.to_json()):
        assert_no_prompt_reaches(cluster, "wrong token")
        wait_for(
            lambda: "bad signature" in cluster["gateway"].log_tail(20000),
            timeout=30,
            what="the gateway to log the ignored registration",
        )


def test_legitimate_registration_redirected_to_another_url_gets_no_prompts(cluster):
    """Copying a real worker's signed heartbeat and pointing it elsewhere breaks the signature."""
    info = json.loads(client(cluster["url"]).get(rs.heartbeat_key(MODEL, "good")))
    info.update(worker_id="evil", url=cluster["evil"].url)
    with registered(cluster["url"], info):
        assert_no_prompt_reaches(cluster, "redirected")
