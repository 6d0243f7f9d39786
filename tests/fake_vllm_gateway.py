"""A real gateway in front of a fake vLLM server (tests/fake_vllm.py): what the vLLM gateway tests
share (tests/test_vllm_routing.py, test_vllm_forwarding.py, test_vllm_failures.py, and
test_vllm_responses.py): the fake started and steered through its /_control, the gateway
started in front of it, and the prompt they send."""

import sys

import httpx
import pytest

from gateway.procs import Proc, free_port, start_gateway

PROMPT = " ".join(f"word{i}" for i in range(60))


def start_fake(tmp_path, name: str = "fake-vllm") -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "tests.fake_vllm", "--port", str(port)]
    argv += ["--events-port", str(free_port()), "--replay-port", str(free_port())]
    return Proc(name, argv, port, str(tmp_path))


@pytest.fixture
def fake(tmp_path):
    proc = start_fake(tmp_path)
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
