"""The fleet a chaos scenario runs against (`bench.chaos`): sim workers on fixed ports (a
killed one restarts on the same one), their gateway, and the probes that watch them (health,
RSS, what is left held once the load stops)."""

import argparse
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.procs import TEST_TOKEN, Proc, Worker, free_port, start_gateway, stop_all, wait_for
from workers.internal_auth import internal_headers


@dataclass
class Fleet:
    """Workers on fixed ports (a restart takes the same one) and their gateway."""

    workers: list[Worker]
    ports: list[int]
    extra: list[str]
    logs: str
    redis: str | None = None
    gateway: Proc | None = None
    events: list[tuple[float, str, str]] = field(default_factory=list)

    def restart(self, i: int) -> None:
        self.workers[i] = Worker(
            worker_id=f"w{i}", port=self.ports[i], redis=self.redis, extra=self.extra, log_dir=self.logs
        ).ready(120)

    def procs(self) -> list[Proc]:
        return [p for p in [self.gateway, *self.workers] if p is not None]


def start_fleet(
    args: argparse.Namespace, logs: str, extra: list[str], redis: str | None = None, gateway_extra: list[str] = ()
) -> Fleet:
    ports = [free_port() for _ in range(args.workers)]
    workers = [Worker(worker_id=f"w{i}", port=p, redis=redis, extra=extra, log_dir=logs) for i, p in enumerate(ports)]
    fleet = Fleet(workers, ports, extra, logs, redis)
    try:
        for w in workers:
            w.ready(120)
        fleet.gateway = start_gateway(
            [] if redis else [w.url for w in workers],
            args.policy,
            redis=redis,
            log_dir=logs,
            extra=[*args.gateway_arg, *gateway_extra],
        )
        fleet.gateway.wait_ready("/v1/models", timeout=120)
        wait_for(lambda: healthy(fleet.gateway) == len(workers), timeout=30, what="every worker healthy")
    except BaseException:
        stop_all(fleet.procs())
        raise
    return fleet


def healthy(gateway: Proc) -> int:
    try:
        return httpx.get(gateway.url + "/health", timeout=5).json()["healthy"]
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


class Sampler(threading.Thread):
    """Calls `probe()` every `interval` seconds into (t, value) samples until stopped."""

    def __init__(self, probe, t0: float, interval: float = 0.5):
        super().__init__(daemon=True)
        self.probe, self.t0, self.interval = probe, t0, interval
        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            try:
                self.samples.append((time.monotonic() - self.t0, self.probe()))
            except (OSError, httpx.HTTPError, ValueError, KeyError):
                pass

    def stop(self) -> list[tuple[float, float]]:
        self.done.set()
        self.join()
        return self.samples


def leaks(fleet: Fleet) -> dict:
    """Blocks held and requests left on each worker, and requests the gateway still holds,
    once the fleet has settled."""

    def settled():
        states = [
            httpx.get(w.url + "/state", timeout=5, headers=internal_headers(TEST_TOKEN)).json() for w in fleet.workers
        ]
        idle = all(s["running"] == s["waiting"] == 0 and s["free_blocks"] == s["total_blocks"] for s in states)
        return states if idle else None

    try:
        states = wait_for(settled, timeout=20, interval=0.2, what="the workers to settle")
    except TimeoutError:
        states = [
            httpx.get(w.url + "/state", timeout=5, headers=internal_headers(TEST_TOKEN)).json() for w in fleet.workers
        ]
    pending = httpx.get(fleet.gateway.url + "/health", timeout=5).json()["pending"]
    return {
        "leaked_blocks": sum(s["total_blocks"] - s["free_blocks"] for s in states),
        "requests_left_on_workers": sum(s["running"] + s["waiting"] for s in states),
        "requests_left_at_gateway": pending,
    }
