"""Admission control and client limits at the gateway: queue bounds answered with 503 and
Retry-After, slow or idle clients timed out, a connection cap; real processes on loopback."""

import concurrent.futures as cf
import json
import socket
import time

import httpx
import pytest

from gateway.procs import Worker, start_gateway, stop_all, wait_for
from tests.test_gateway_faults import slow_profile

MODEL = "smollm2-135m"
LONG = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 2000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """One worker running one request at a time, behind gateways with tight bounds."""
    tmp = tmp_path_factory.mktemp("limits")
    logs = str(tmp)
    worker = Worker(worker_id="w", log_dir=logs, extra=("--max-num-seqs", "1", "--sim-profile", slow_profile(tmp)))
    gateways = {
        "queue": start_gateway(
            [worker.url],
            "round_robin",
            name="gw-queue",
            log_dir=logs,
            extra=["--max-queue-per-worker", "2", "--retry-after-s", "2"],
        ),
        "pending": start_gateway(
            [worker.url], "round_robin", name="gw-pending", log_dir=logs, extra=["--max-pending", "2"]
        ),
        "slow": start_gateway(
            [worker.url],
            "round_robin",
            name="gw-slow",
            log_dir=logs,
            extra=["--client-header-timeout", "1", "--client-body-timeout", "1"],
        ),
        "cap": start_gateway(
            [worker.url], "round_robin", name="gw-cap", log_dir=logs, extra=["--max-connections", "3"]
        ),
    }
    try:
        worker.ready()
        for g in gateways.values():
            g.wait_ready("/v1/models")
            g.wait_healthy(1, what="the worker")
        yield {"worker": worker, **gateways}
    finally:
        stop_all([*gateways.values(), worker])


def complete(url: str, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True},
    )


def assert_refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == "server_error" and err["message"]
    assert int(r.headers["retry-after"]) >= 1


def test_a_full_worker_queue_is_answered_503_with_retry_after(procs):
    """The worker runs one request; two may wait behind it; a fourth is refused at once."""
    gw = procs["queue"]
    with httpx.stream("POST", gw.url + "/v1/completions", json=LONG, timeout=60) as running:
        lines = running.iter_lines()  # kept: a dropped line iterator closes the connection
        next(ln for ln in lines if ln.startswith("data: "))
        with cf.ThreadPoolExecutor(2) as pool:
            queued = [pool.submit(complete, gw.url) for _ in range(2)]
            wait_for(lambda: gw.metric("kvgate_gateway_in_flight") == 3, what="2 queued requests")
            r = complete(gw.url)
            assert_refused(r, 503, "overloaded")
            assert r.headers["retry-after"] == "2"
            running.close()
            assert all(f.result().status_code == 200 for f in queued)
    assert gw.metric("kvgate_gateway_refused_total", reason="worker_queues_full") == 1
    assert complete(gw.url).status_code == 200


def test_the_gateway_holds_at_most_max_pending_requests(procs):
    gw = procs["pending"]
    with httpx.stream("POST", gw.url + "/v1/completions", json=LONG, timeout=60) as running:
        lines = running.iter_lines()
        next(ln for ln in lines if ln.startswith("data: "))
        with cf.ThreadPoolExecutor(1) as pool:
            queued = pool.submit(complete, gw.url)
            wait_for(lambda: httpx.get(gw.url + "/health").json()["pending"] == 2, what="2 pending requests")
            assert_refused(complete(gw.url), 503, "overloaded")
            running.close()
            assert queued.result().status_code == 200
    wait_for(lambda: httpx.get(gw.url + "/health").json()["pending"] == 0, what="the requests to end")
    assert gw.metric("kvgate_gateway_refused_total", reason="overloaded") == 1
    assert complete(gw.url).status_code == 200


def read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes; raises socket.timeout if it never does."""
    sock.settimeout(timeout)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)))


def test_a_trickling_request_head_gets_408_and_is_closed(procs):
    gw = procs["slow"]
    with connect(gw.url) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        for _ in range(3):
            time.sleep(0.3)
            s.sendall(b"x")  # a header that never ends: every byte arrives in time, the head never does
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 408")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_an_endless_request_head_gets_431_and_is_closed(procs):
    with connect(procs["slow"].url) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-long: " + b"a" * 70_000)
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 431")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_head_too_large"


def test_a_silent_connection_is_closed(procs):
    with connect(procs["slow"].url) as s:
        assert read_all(s) == b""


def test_a_trickling_body_gets_408_and_is_closed(procs):
    with connect(procs["slow"].url) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model":'
        )
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 408")
    gw = procs["slow"]
    assert complete(gw.url).status_code == 200
    # the request the gateway had started on is a client gone (499), not an internal error
    assert gw.metric("kvgate_gateway_requests_total", status="499") == 1
    assert gw.metric("kvgate_gateway_requests_total", status="500") == 0


def test_connections_beyond_the_cap_get_503_not_a_reset(procs):
    gw = procs["cap"]
    idle = [connect(gw.url) for _ in range(3)]
    try:
        assert_refused(complete(gw.url), 503, "overloaded")
    finally:
        for s in idle:
            s.close()
    assert wait_for(lambda: complete(gw.url).status_code == 200, what="room for a connection")
