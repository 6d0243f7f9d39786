"""The `vllm` worker kind: a vLLM (or SGLang) server in the fleet, seen as our own workers are.

Health and load come over HTTP, polled like a kvgate worker's `/state`: `/health` and
`/metrics` every `interval` seconds, `/v1/models` and `/kv_event_sources` whenever the server
(re)appears. One failed poll takes it out of the candidate set and drops its residency; a
changed `process_start_time_seconds` means it restarted, so its residency is dropped and
synced again. Residency comes from its ZMQ KV events (`vllm_subscriber`), re-hashed into
kvgate's chain at the gateway's block size; the subscriber runs while the server is up and
Redis does not carry its residency (a `kvgate bridge` publishes it there). Policies see an
ordinary WorkerView in the server's own block size: matched prefix blocks are counted in the
gateway's smaller blocks and converted. Nothing here is on the routing path.

`--worker vllm:URL` (or `sglang:URL`) adds one; the event endpoints come from
`/kv_event_sources` unless given as `vllm:URL?kv_events=ENDPOINT&kv_replay=ENDPOINT&kv_topic=T`.
"""
import asyncio
import logging
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit, urlunsplit

import aiohttp

from gateway.index import RESYNC, ResidencyIndex
from gateway.vllm_metrics import (BadAnswer, EventSource, parse_metrics, parse_models, parse_sources,
                                  replay_address, subscribe_address, worker_id)
from workers.kv.events import EventBatch, KVEvent

log = logging.getLogger("kvgate.gateway")

KIND = "vllm"
PREFIXES = ("vllm:", "sglang:")
ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ValueError)
RETRY_S = 5.0


@dataclass(frozen=True)
class Spec:
    """`--worker vllm:URL[?kv_events=..&kv_replay=..&kv_topic=..]`, parsed."""
    url: str
    events: str | None = None
    replay: str | None = None
    topic: str = ""


def parse_spec(spec: str) -> Spec | None:
    """The vLLM worker a `--worker` value names, or None for a kvgate worker's plain URL."""
    prefix = next((p for p in PREFIXES if spec.startswith(p)), None)
    if prefix is None:
        return None
    parts = urlsplit(spec[len(prefix):])
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--worker {spec!r}: a vLLM worker is {prefix}http(s)://HOST:PORT")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"kv_events", "kv_replay", "kv_topic"}
    if unknown:
        raise ValueError(f"--worker {spec!r}: unknown option(s) {sorted(unknown)}")
    url = urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
    return Spec(url, query.get("kv_events"), query.get("kv_replay"), query.get("kv_topic", ""))


class IndexSink:
    """A subscriber's residency changes into the gateway's index, numbered as one worker's
    events; ignored while Redis carries this worker's residency."""

    def __init__(self, index: ResidencyIndex, wid: str, paused):
        self.index, self.wid, self.paused = index, wid, paused
        self.seq = 0

    def reset(self) -> None:
        if not self.paused():
            self.index.reset(self.wid, (), 0)
        self.seq = 0

    def apply(self, changes: list) -> bool:
        """`changes` are vllm_translate.Change: residency transitions in order."""
        if self.paused():
            return True
        events = [KVEvent(self.seq + i + 1, c.kind, c.hashes) for i, c in enumerate(changes)]
        self.seq += len(changes)
        return self.index.apply(EventBatch(self.wid, events, self.seq)) != RESYNC


class VllmKind:
    """Adds vLLM workers to a Fleet: `Fleet(kinds={"vllm": VllmKind(...)})`."""

    def __init__(self, block_size: int = 16, profile: dict | None = None, needs_cost: bool = False):
        self.block_size = block_size
        self.profile = profile
        self.needs_cost = needs_cost
        self.specs: dict[str, Spec] = {}
        self.links: dict[str, "VllmLink"] = {}

    def add(self, spec: Spec) -> str:
        """Remember a worker's options; returns the URL to `Fleet.add` it under."""
        self.specs[spec.url] = spec
        return spec.url

    def spawn(self, fleet, w) -> list[asyncio.Task]:
        link = self.links[w.url] = VllmLink(self, fleet, w, self.specs.get(w.url, Spec(w.url)))
        return [asyncio.create_task(link.run())]


class VllmLink:
    def __init__(self, kind: VllmKind, fleet, w, spec: Spec):
        self.kind, self.fleet, self.w, self.spec = kind, fleet, w, spec
        self.wid = worker_id(w.url)
        self.host = urlsplit(w.url).hostname
        self.model: str | None = None
        self.max_model_len: int | None = None
        self.sources: list[EventSource] = []
        self.started: float | None = None
        self.translator = None
        self.subscriber = None
        self.task: asyncio.Task | None = None
        self.warned = False

    async def run(self) -> None:
        try:
            while True:
                t0 = time.monotonic()
                await self.poll()
                self.steer()
                await asyncio.sleep(max(0.0, self.fleet.interval - (time.monotonic() - t0)))
        finally:
            self.stop_subscriber()

    async def poll(self) -> None:
        try:
            await self.text("/health")
            load = parse_metrics(await self.text("/metrics"))
            if load.started != self.started or self.model is None:
                await self.discover(load.started)
        except (*ERRORS, BadAnswer) as e:
            self.fleet._down(self.w, f"vLLM poll failed: {e!r}")
            self.model = None
            return
        free, total = load.kv_blocks()
        bs = load.block_size or self.kind.block_size
        profile = self.kind.profile or {}
        state = {"worker_id": self.wid, "kind": KIND, "model": self.model, "role": "mixed", "block_size": bs,
                 "waiting": load.waiting, "running": load.running, "free_blocks": free, "total_blocks": total,
                 "kv_tokens": (total - free) * bs, "max_model_len": self.max_model_len,
                 "max_batched_tokens": profile.get("max_batched_tokens") or 2048,
                 "cost_model": self.kind.profile}
        self.fleet._up(self.w, state)
        self.w.hash_ratio = max(1, bs // self.kind.block_size)
        self.warn_once()

    async def discover(self, started: float | None) -> None:
        """Model, context and event endpoints of a server seen for the first time or restarted."""
        if self.started is not None and started != self.started:
            log.warning("vLLM worker %s at %s restarted: resyncing its residency", self.wid, self.w.url)
            self.stop_subscriber()
            self.fleet.index.drop(self.wid)
        self.model, self.max_model_len = parse_models(await self.json("/v1/models"))
        self.sources = await self.event_sources()
        self.started = started

    async def event_sources(self) -> list[EventSource]:
        if self.spec.events:
            return [EventSource(0, self.spec.events, self.spec.replay, self.spec.topic)]
        try:
            sources = parse_sources(await self.json("/kv_event_sources"))
        except aiohttp.ClientResponseError as e:
            if e.status != 404:
                raise
            sources = []
        if not sources and not self.sources:
            log.warning("vLLM worker %s publishes no KV events (start it with --kv-events-config, or give "
                        "?kv_events=ENDPOINT): routing to it cache-blind", self.w.url)
        if len(sources) > 1:
            log.warning("vLLM worker %s has %d data-parallel ranks: following rank %d's events only",
                        self.w.url, len(sources), sources[0].rank)
        return sources[:1]

    def warn_once(self) -> None:
        if self.kind.needs_cost and self.kind.profile is None and not self.warned:
            log.warning("vLLM worker %s has no cost model: slo_goodput predicts its TTFT and TPOT with the "
                        "default model; measure one with `kvgate calibrate --url %s --out P.json` and pass "
                        "--vllm-profile P.json", self.wid, self.w.url)
        self.warned = True

    def steer(self) -> None:
        """Run the subscriber exactly while the server is up and its residency is ours to follow."""
        want = self.w.healthy and not self.w.redis_residency and bool(self.sources) and self.model is not None
        if want and (self.task is None or self.task.done()):
            self.start_subscriber()
        elif not want and self.task is not None:
            self.stop_subscriber()

    def start_subscriber(self) -> None:
        from gateway.vllm_subscriber import Subscriber  # pyzmq and msgpack: only where vLLM workers are
        from gateway.vllm_translate import Translator
        src = self.sources[0]
        address, bind = subscribe_address(src.endpoint, self.host)
        replay = replay_address(src.replay, self.host) if src.replay else None
        self.translator = Translator(self.model, self.kind.block_size)
        sink = IndexSink(self.fleet.index, self.wid, lambda: self.w.redis_residency)
        self.subscriber = Subscriber(address, bind, replay, src.topic, self.translator, sink, self.wid)
        self.task = asyncio.create_task(self._follow(self.subscriber))

    async def _follow(self, sub) -> None:
        try:
            await sub.run()
        except Exception as e:  # a socket that cannot bind, say: a poll tries again in a while
            log.warning("kv events of %s at %s failed: %r", self.wid, sub.address, e)
            await asyncio.sleep(RETRY_S)

    def stop_subscriber(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def text(self, path: str) -> str:
        timeout = aiohttp.ClientTimeout(total=self.fleet.timeout)
        async with self.fleet.session.get(self.w.url + path, timeout=timeout) as r:
            r.raise_for_status()
            return await r.text()

    async def json(self, path: str) -> object:
        return await self.fleet.get(self.w.url + path, self.fleet.timeout)
