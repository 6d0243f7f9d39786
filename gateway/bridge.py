"""`kvgate bridge`: a sidecar that puts one vLLM (or SGLang) server's residency and load into
Redis, in the schema kvgate's own workers write (workers/kv/redis_schema.py), so that gateway
replicas route by it with no ZMQ of their own.

    kvgate bridge --vllm http://10.0.0.5:8000 --redis redis://redis:6379/0 --block-size 16

It follows the server like the gateway's vLLM worker kind (vllm_link: health and load over HTTP,
KV events over ZMQ replayed on start, on a gap and after a restart, re-hashed into kvgate's chain
at the fleet's block size) and hands the residency changes to the RedisPublisher a kvgate worker
runs: one stream entry per change, the resident set and its seq in one transaction, and a
heartbeat signed with the fleet's internal token whose state says `kind: vllm`, so gateways
that discover the server in Redis poll it as a vLLM server. The worker id is the one gateways
derive from the URL (`vllm@HOST:PORT`), so `--advertise-url` must be the URL gateways use.
While the server is down or restarting its set is emptied, then rebuilt from its events.
"""

import argparse
import asyncio
import concurrent.futures
import logging
import os
import signal

from gateway.vllm_link import VllmLink
from gateway.vllm_metrics import worker_id
from gateway.vllm_worker import parse_spec
from workers.cli_help import HelpFormatter
from workers.kv.events import CLEARED, EventLog, KVSnapshot
from workers.kv.redis_schema import redact_url


class ServerEngine:
    """The `KVSource` a RedisPublisher reads, for a server followed from outside: its id, its
    event log, its resident hashes and its state, all on this process's event loop."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.events = EventLog(worker_id)
        self.link: "BridgeLink | None" = None
        self.load: dict = {"kind": "vllm", "worker_id": worker_id}

    def kv_snapshot(self) -> concurrent.futures.Future:
        """The KVSnapshot now: everything here runs on this process's event loop."""
        t = self.link.translator if self.link is not None else None
        done: concurrent.futures.Future = concurrent.futures.Future()
        seq = self.events.last_seq
        done.set_result(
            KVSnapshot(self.worker_id, seq, sorted(t.resident), t.tiers())
            if t is not None
            else KVSnapshot(self.worker_id, seq, [])
        )
        return done

    def state(self) -> dict:
        return self.load


class LogSink:
    """A subscriber's residency changes as the engine's numbered events."""

    def __init__(self, log: EventLog):
        self.log = log

    def reset(self) -> None:
        self.log.append(CLEARED)
        self.log.publish()

    def apply(self, changes: list) -> bool:
        """One batch of the subscriber's changes: the bridge's step, published at once."""
        for c in changes:
            self.log.append(c.kind, c.hashes, medium=c.medium)
        self.log.publish()
        return True


class BridgeLink(VllmLink):
    def __init__(self, engine: ServerEngine, url: str, block_size: int, interval: float, timeout: float, events=None):
        super().__init__(url, block_size, interval, timeout, events)
        self.engine = engine
        self.healthy = False
        self.ready = asyncio.Event()

    def up(self, state: dict) -> None:
        self.engine.load = state
        self.healthy = True
        self.ready.set()

    def down(self, why: str) -> None:
        if self.healthy:
            logging.getLogger("kvgate.bridge").warning("%s is down (%s): its residency is unknown", self.url, why)
            self.engine.events.append(CLEARED)
            self.engine.events.publish()
        self.healthy = False

    def restarted(self) -> None:
        self.engine.events.append(CLEARED)
        self.engine.events.publish()

    def following(self) -> bool:
        return self.healthy

    def sink(self) -> LogSink:
        return LogSink(self.engine.events)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate bridge", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--vllm",
        required=True,
        metavar="URL",
        help="the vLLM server (vllm:URL?kv_events=..&kv_replay=.. forms are taken too)",
    )
    p.add_argument(
        "--redis",
        default=os.environ.get("KVGATE_REDIS_URL"),
        metavar="URL",
        help="redis://[:PASSWORD@]HOST:PORT/DB (default: $KVGATE_REDIS_URL)",
    )
    p.add_argument(
        "--internal-token",
        default=os.environ.get("KVGATE_INTERNAL_TOKEN"),
        help="the fleet's shared secret that signs the registration (default: $KVGATE_INTERNAL_TOKEN)",
    )
    p.add_argument("--advertise-url", help="the server's URL as gateways reach it (default: --vllm)")
    p.add_argument("--block-size", type=int, default=16, help="the gateways' --block-size (their hashes)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between /health + /metrics polls")
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="the lowest level logged (stderr)",
    )
    return p


async def serve(args: argparse.Namespace) -> None:
    from workers.redis_publisher import RedisPublisher

    spec = parse_spec(args.vllm if args.vllm.startswith(("vllm:", "sglang:")) else "vllm:" + args.vllm)
    assert spec is not None, "a vllm: or sglang: spec always parses"
    advertise = (args.advertise_url or spec.url).rstrip("/")
    engine = ServerEngine(worker_id(advertise))
    link = engine.link = BridgeLink(engine, spec.url, args.block_size, args.interval, 1.0, spec.source())
    link.wid = engine.worker_id
    task = asyncio.create_task(link.run())
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    publisher = None
    try:
        await _first(link.ready.wait(), stop.wait())
        if not stop.is_set():
            assert link.model is not None, "the link is ready once it knows the model"
            publisher = RedisPublisher(engine, args.redis, advertise, link.model, args.internal_token, engine.state)
            await publisher.start()
            print(
                f"kvgate bridge: {spec.url} ({link.model}) as {engine.worker_id} -> {redact_url(args.redis)}",
                flush=True,
            )
            await stop.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if publisher is not None:
            await publisher.stop()


async def _first(*aws) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        t.cancel()


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not args.redis or not args.internal_token:
        raise SystemExit(
            "kvgate bridge: needs --redis and --internal-token (or $KVGATE_REDIS_URL, "
            "$KVGATE_INTERNAL_TOKEN): gateways accept only signed registrations"
        )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(args))
