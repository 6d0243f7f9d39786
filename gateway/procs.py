"""Child processes on loopback: workers, gateways, redis-server, for `kvgate demo`, the
benchmarks and the tests (one implementation of free port, start, wait for health, stop).

Every process runs in its own process group and is stopped by group (SIGTERM, then SIGKILL),
so nothing outlives a test even when it fails; output goes to a log file whose tail is shown
when a process does not come up.
"""

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from workers.internal_auth import TOKEN_ENV, TOKEN_HEADER

ROOT = Path(__file__).resolve().parents[1]
KVGATE = [sys.executable, "-m", "gateway.cli"]
TEST_TOKEN = "kvgate-test-internal-token"  # the fleet secret of workers and gateways started here with Redis


def free_port() -> int:
    """A loopback port that binds now, picked below the kernel's ephemeral range: a port the
    kernel hands out (bind to 0) may be handed again to an outgoing connection before the
    child process binds it, and ports below the range are never handed out that way. Never one
    this process handed out already (until half the range has been): a fixture picks ports
    for several children before any binds, and two random picks of one port failed a suite
    run with "Address already in use". `KVGATE_PORTS=LOW-HIGH` narrows the pick, for
    processes sharing a host by port ranges."""
    low, high = port_range()
    if len(_handed_out) >= (high - low) // 2:
        _handed_out.clear()
    while True:
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


_handed_out: set[int] = set()


def _token(argv: list[str], env: dict[str, str]) -> str | None:
    """The internal token a child was given: `--internal-token X`, else by environment."""
    if "--internal-token" in argv:
        return argv[argv.index("--internal-token") + 1]
    return env.get(TOKEN_ENV)


def port_range() -> tuple[int, int]:
    """Where `free_port` picks: `KVGATE_PORTS` (inclusive), else 10000 up to the ephemeral range."""
    given = os.environ.get("KVGATE_PORTS", "")
    if given:
        low, high = (int(n) for n in given.split("-"))
        return low, high + 1
    return 10000, ephemeral_low()


def ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class Proc:
    """A child process in its own group, with a log file and a base URL."""

    def __init__(
        self, name: str, argv: list[str], port: int, log_dir: str | None = None, env: dict[str, str] | None = None
    ):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="kvgate-")) / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)  # a bench's --log-dir need not exist yet
        self._log = open(self.log_path, "wb")
        self.token = _token(argv, env or {})
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **(env or {}))
        self.popen = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )

    def internal(self, path: str, **kw) -> httpx.Response:
        """GET one of a worker's internal endpoints, with its internal token if it has one."""
        return httpx.get(self.url + path, headers={TOKEN_HEADER: self.token} if self.token else None, **kw)

    def state(self) -> dict:
        return self.internal("/state").json()

    def reset_cache(self) -> None:
        """Empty a worker's prefix cache (POST /kv/reset with its internal token), so a benchmark
        run starts cold."""
        headers = {TOKEN_HEADER: self.token} if self.token else None
        httpx.post(self.url + "/kv/reset", headers=headers, timeout=30).raise_for_status()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def wait_ready(self, path: str = "/health", timeout: float = 60.0) -> "Proc":
        """Poll `path` until it answers 200; raise with the log tail if it never does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready on {self.url}{path} after {timeout}s:\n{self.log_tail()}")

    def healthy(self) -> int:
        """How many workers a gateway counts healthy (GET /health)."""
        return httpx.get(self.url + "/health", timeout=10).json()["healthy"]

    def wait_healthy(self, n: int, timeout: float = 30.0, what: str | None = None) -> "Proc":
        """Wait until a gateway counts `n` healthy workers."""
        wait_for(lambda: self.healthy() == n, timeout, what=what or f"{self.name}: {n} healthy workers")
        return self

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` on GET /metrics whose labels include `labels`."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the whole group, as a crash would."""
        self.signal(signal.SIGKILL)
        self.popen.wait()
        self._log.close()

    def stop(self, grace: float = 5.0) -> None:
        if self.alive:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill()  # whatever is left in the group


class Worker(Proc):
    """A `kvgate worker` for smollm2-135m on a free port (sim executor unless told otherwise)."""

    def __init__(
        self,
        executor: str = "sim",
        worker_id: str = "w0",
        port: int | None = None,
        redis: str | None = None,
        extra: Sequence[str] = (),
        model: str = "smollm2-135m",
        log_dir: str | None = None,
    ):
        port = port or free_port()
        argv = KVGATE + [
            "worker",
            "--model",
            model,
            "--executor",
            executor,
            "--port",
            str(port),
            "--worker-id",
            worker_id,
            *extra,
        ]
        if redis:
            argv += ["--redis", redis]
        super().__init__(worker_id, argv, port, log_dir, redis_env(redis))
        self.worker_id = worker_id

    def ready(self, timeout: float = 180.0) -> "Worker":
        self.wait_ready("/health", timeout)
        return self


def start_worker(
    worker_id: str,
    port: int | None = None,
    executor: str = "sim",
    redis: str | None = None,
    extra: Sequence[str] = (),
    log_dir: str | None = None,
) -> Worker:
    return Worker(executor, worker_id, port, redis, extra, log_dir=log_dir)


def start_gateway(
    workers: Sequence[str] = (),
    policy: str = "prefix_affinity",
    port: int | None = None,
    redis: str | None = None,
    extra: Sequence[str] = (),
    name: str = "gateway",
    log_dir: str | None = None,
    env: dict[str, str] | None = None,
) -> Proc:
    port = port or free_port()
    argv = KVGATE + ["gateway", "--port", str(port), "--policy", policy, "--model", "smollm2-135m", *extra]
    for url in workers:
        argv += ["--worker", url]
    if redis:
        argv += ["--redis", redis]
    return Proc(name, argv, port, log_dir, {**redis_env(redis), **(env or {})})


def redis_env(redis: str | None) -> dict[str, str]:
    """Processes that meet through Redis share the fleet's internal token (registrations are
    signed with it); given by environment so that only those processes get it."""
    return {TOKEN_ENV: TEST_TOKEN} if redis else {}


def start_redis(port: int | None = None, log_dir: str | None = None, extra: Sequence[str] = ()) -> Proc:
    """A private, memory-only redis-server (never the shared one on 6379); `extra` adds options
    (a password, TLS)."""
    port = port or free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra]
    return Proc("redis", argv, port, log_dir)


def wait_redis(proc: Proc, timeout: float = 30.0, url: str | None = None) -> Proc:
    """Wait until the server answers PING, at `url` when given (password, TLS), else plainly."""
    import redis

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client = (
                redis.Redis.from_url(url, socket_timeout=0.5)
                if url
                else redis.Redis(port=proc.port, socket_timeout=0.5)
            )
            if client.ping():
                return proc
        except (redis.RedisError, OSError):
            time.sleep(0.05)
    raise TimeoutError(f"redis-server not up on port {proc.port}:\n{proc.log_tail()}")


def stop_all(procs: list[Proc]) -> None:
    for p in procs:
        p.stop()


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate` until it returns something truthy; returns that. `timeout` is a bound on
    a wait that should end, generous so a busy machine does not fail it; polling ends early."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


async def wait_until(predicate, timeout: float = 30.0, interval: float = 0.01, what: str = "condition"):
    """`wait_for` inside an event loop: the loop runs between polls."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
