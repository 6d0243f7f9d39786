"""A client that talks to a worker directly meets the gateway's client limits
(workers/http_server.py): on real `kvgate worker` processes (sim executor), a request head or
body that does not arrive in time gets a 408 and the connection is closed, a silent connection
is closed, and a connection beyond --max-connections gets an OpenAI-shaped 503 with Retry-After.
A plain uvicorn worker waited on all of them and served every connection."""

import json
import socket

import httpx
import pytest

from gateway.procs import Worker, stop_all, wait_for


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """One worker with 1 s head and body deadlines, one that takes 3 connections at most."""
    logs = str(tmp_path_factory.mktemp("worker-limits"))
    procs = {
        "slow": Worker(
            worker_id="slow", log_dir=logs, extra=("--client-header-timeout", "1", "--client-body-timeout", "1")
        ),
        "cap": Worker(worker_id="cap", log_dir=logs, extra=("--max-connections", "3")),
    }
    try:
        for w in procs.values():
            w.ready()
        yield procs
    finally:
        stop_all(list(procs.values()))


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)))


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; raises socket.timeout if it never does (a
    bound on a wait that should end, generous for a busy machine)."""
    sock.settimeout(30)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def openai_error(body: bytes) -> dict:
    """The error object of an OpenAI-shaped error body."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def assert_timed_out(answer: bytes) -> None:
    """A whole raw answer: 408 with the OpenAI error `request_timeout`."""
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408")
    assert openai_error(body)["code"] == "request_timeout"


def test_a_request_head_that_stops_coming_gets_408_and_is_closed(workers):
    with connect(workers["slow"].url) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # and nothing more
        assert_timed_out(read_all(s))


def test_a_request_body_that_stops_coming_gets_408_and_is_closed(workers):
    with connect(workers["slow"].url) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model":'
        )
        assert_timed_out(read_all(s))


def test_a_silent_connection_is_closed(workers):
    with connect(workers["slow"].url) as s:
        assert read_all(s) == b""


def test_connections_beyond_the_cap_get_an_openai_shaped_503(workers):
    url = workers["cap"].url
    idle = [connect(url) for _ in range(3)]
    try:
        r = httpx.get(url + "/v1/models", timeout=30)
    finally:
        for s in idle:
            s.close()
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
    error = openai_error(r.content)
    assert error["code"] == "overloaded" and error["type"] == "server_error"
    assert wait_for(lambda: httpx.get(url + "/v1/models", timeout=30).status_code == 200, what="room for a connection")
