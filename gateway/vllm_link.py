"""One vLLM (or SGLang) server followed over HTTP and ZMQ: the part the gateway's vLLM worker
kind and `kvgate bridge` share.

Health and load: `/health` and `/metrics` every `interval` seconds, `/v1/models` and
`/kv_event_sources` whenever the server (re)appears. A failed poll is `down`; a changed
`process_start_time_seconds` is a restart (its cache is gone). Residency: a ZMQ subscriber
(`vllm_subscriber`) re-hashing its events into kvgate's chain at `block_size`, running while
`following()` says so. Subclasses say where the state and residency go.
"""

import asyncio
import logging
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp

from gateway.upstream import UPSTREAM_KEEPALIVE_S
from gateway.vllm_metrics import (
    BadAnswer,
    EventSource,
    VllmLoad,
    parse_metrics,
    parse_models,
    parse_sources,
    replay_address,
    subscribe_address,
    worker_id,
)

if TYPE_CHECKING:  # pyzmq and msgpack are imported only when a link follows events
    from gateway.vllm_subscriber import Subscriber, SubscriberStats
    from gateway.vllm_translate import Translator, TranslateStats

log = logging.getLogger("kvgate.gateway")

KIND = "vllm"
ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ValueError, BadAnswer)
RETRY_S = 5.0


class VllmLink:
    def __init__(
        self,
        url: str,
        block_size: int,
        interval: float,
        timeout: float,
        events: EventSource | None = None,
        profile: dict | None = None,
    ):
        self.url, self.block_size, self.interval, self.timeout = url, block_size, interval, timeout
        self.events, self.profile = events, profile
        self.wid = worker_id(url)
        self.host = urlsplit(url).hostname or "127.0.0.1"
        self.model: str | None = None
        self.max_model_len: int | None = None
        self.sources: list[EventSource] = []
        self.started: float | None = None
        self.translator: Translator | None = None
        self.subscriber: Subscriber | None = None
        self.task: asyncio.Task | None = None
        self.http: aiohttp.ClientSession | None = None
        self.stats: tuple[SubscriberStats, TranslateStats] | None = None  # over every subscriber this link ran

    # what subclasses decide

    def up(self, state: dict) -> None:
        """The server answered: its state (kvgate's /state fields)."""

    def down(self, why: str) -> None:
        """The server did not answer; its residency is unknown."""

    def restarted(self) -> None:
        """The server restarted: residency held for it is stale."""

    def following(self) -> bool:
        """Whether its events should be followed now."""
        return True

    def sink(self):
        """Where the subscriber puts residency changes (vllm_subscriber.Sink)."""
        raise NotImplementedError

    # the loop

    async def run(self) -> None:
        """Poll and follow until cancelled. The HTTP session is the link's own: the fleet's sends
        kvgate's internal token, which a vLLM server has no use for."""
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_KEEPALIVE_S))
        try:
            while True:
                t0 = time.monotonic()
                await self.poll()
                self.steer()
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - t0)))
        finally:
            self.stop_subscriber()
            await self.http.close()

    async def poll(self) -> None:
        try:
            await self.text("/health")
            load = parse_metrics(await self.text("/metrics"))
            if load.started != self.started or self.model is None:
                await self.discover(load.started)
        except ERRORS as e:
            self.model = None
            self.stop_subscriber()
            self.down(f"vLLM poll failed: {e!r}")
            return
        try:
            self.up(self.state(load))
        except ValueError as e:  # a number past what a state holds (`WorkerState.from_json`)
            self.down(f"vLLM state is not one: {e}")

    def state(self, load: VllmLoad) -> dict:
        """The server as a kvgate worker's `/state` would describe it."""
        free, total = load.kv_blocks()
        bs = load.block_size or self.block_size
        profile = self.profile or {}
        return {
            "worker_id": self.wid,
            "kind": KIND,
            "model": self.model,
            "role": "mixed",
            "block_size": bs,
            "waiting": load.waiting,
            "running": load.running,
            "free_blocks": free,
            "total_blocks": total,
            "kv_tokens": (total - free) * bs,
            "max_model_len": self.max_model_len,
            "max_batched_tokens": profile.get("max_batched_tokens") or 2048,
            "max_num_seqs": profile.get("max_num_seqs") or 256,
            "cost_model": self.profile,
        }

    async def discover(self, started: float | None) -> None:
        """Model, context and event endpoints of a server seen for the first time or restarted."""
        if self.started is not None and started != self.started:
            log.warning("vLLM worker %s at %s restarted: resyncing its residency", self.wid, self.url)
            self.stop_subscriber()
            self.restarted()
        self.model, self.max_model_len = parse_models(await self.json("/v1/models"))
        self.sources = await self.event_sources()
        self.started = started

    async def event_sources(self) -> list[EventSource]:
        if self.events is not None:
            return [self.events]
        try:
            sources = parse_sources(await self.json("/kv_event_sources"))
        except aiohttp.ClientResponseError as e:
            if e.status != 404:
                raise
            sources = []
        if not sources and not self.sources:
            log.warning(
                "vLLM worker %s publishes no KV events (start it with --kv-events-config, or give "
                "?kv_events=ENDPOINT): routing to it cache-blind",
                self.url,
            )
        if len(sources) > 1:
            log.warning(
                "vLLM worker %s has %d data-parallel ranks: following rank %d's events only",
                self.url,
                len(sources),
                sources[0].rank,
            )
        return sources[:1]

    def steer(self) -> None:
        """Run the subscriber exactly while the server is up and its events are to be followed."""
        want = self.model is not None and bool(self.sources) and self.following()
        if want and (self.task is None or self.task.done()):
            self.start_subscriber()
        elif not want and self.task is not None:
            self.stop_subscriber()

    def start_subscriber(self) -> None:
        from gateway.vllm_subscriber import Subscriber, SubscriberStats  # pyzmq, msgpack: only if used
        from gateway.vllm_translate import Translator, TranslateStats

        assert self.model is not None, "steer follows events only once the model is known"
        if self.stats is None:
            self.stats = (SubscriberStats(), TranslateStats())
        src = self.sources[0]
        address, bind = subscribe_address(src.endpoint, self.host)
        replay = replay_address(src.replay, self.host) if src.replay else None
        translator = self.translator = Translator(self.model, self.block_size, self.stats[1])
        subscriber = self.subscriber = Subscriber(
            address, bind, replay, src.topic, translator, self.sink(), self.wid, stats=self.stats[0]
        )
        self.task = asyncio.create_task(self._follow(subscriber))

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

    def _http(self) -> aiohttp.ClientSession:
        assert self.http is not None, "run() opens the session before any request"
        return self.http

    async def text(self, path: str) -> str:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with self._http().get(self.url + path, timeout=timeout) as r:
            r.raise_for_status()
            return await r.text()

    async def json(self, path: str) -> object:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with self._http().get(self.url + path, timeout=timeout) as r:
            r.raise_for_status()
            return await r.json(content_type=None)
