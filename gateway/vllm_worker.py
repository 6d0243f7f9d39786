"""The `vllm` worker kind: a vLLM (or SGLang) server in the fleet, seen as our own workers are.

`--worker vllm:URL` (or `sglang:URL`) adds one; its event endpoints come from
`/kv_event_sources` unless given as `vllm:URL?kv_events=ENDPOINT&kv_replay=ENDPOINT&kv_topic=T`.
Its link (vllm_link) is polled like a kvgate worker's `/state`: one failed poll takes it out of
the candidate set and drops its residency, a restart drops it too and the events are synced
again. Its residency goes into the gateway's index while Redis does not carry it (a
`kvgate bridge` publishes it there). Policies see an ordinary WorkerView in the server's own
block size: matched prefix blocks are counted in the gateway's (smaller) blocks and converted
(`Worker.hash_ratio`). Nothing here is on the routing path.
"""

import asyncio
import logging
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit, urlunsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.index import RESYNC, ResidencyIndex
from gateway.vllm_link import KIND as KIND  # the kind's name, read as vllm_worker.KIND
from gateway.vllm_link import VllmLink
from gateway.vllm_metrics import EventSource
from workers.kv.events import EventBatch, KVEvent

log = logging.getLogger("kvgate.gateway")

PREFIXES = ("vllm:", "sglang:")
COUNTERS = (
    ("batches", "KV event batches applied (live or replayed)", ["worker"]),
    ("resyncs", "Syncs from the publisher's replay buffer (start, restart, lost batches)", ["worker"]),
    ("gaps", "Sequence gaps seen in the live stream", ["worker"]),
    ("restarts", "Sequence numbers that went back (the server restarted)", ["worker"]),
    ("bad_batches", "KV event messages stepped over whole: no batch, or no readable seq", ["worker"]),
    ("bad_events", "Malformed KV events or batch ts/dp_rank; of an event only a clear or removal applied", ["worker"]),
    ("blocks", "Engine blocks by outcome: stored, removed, or skipped (no kvgate hash)", ["worker", "outcome"]),
)


@dataclass(frozen=True)
class Spec:
    """`--worker vllm:URL[?kv_events=..&kv_replay=..&kv_topic=..]`, parsed."""

    url: str
    events: str | None = None
    replay: str | None = None
    topic: str = ""

    def source(self) -> EventSource | None:
        return EventSource(0, self.events, self.replay, self.topic) if self.events else None


def parse_spec(spec: str) -> Spec | None:
    """The vLLM worker a `--worker` value names, or None for a kvgate worker's plain URL."""
    prefix = next((p for p in PREFIXES if spec.startswith(p)), None)
    if prefix is None:
        return None
    parts = urlsplit(spec[len(prefix) :])
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
    events; ignored while `paused()` (Redis carries this worker's residency)."""

    def __init__(self, index: ResidencyIndex, wid: str, paused):
        self.index, self.wid, self.paused = index, wid, paused
        self.seq = 0

    def reset(self) -> None:
        if not self.paused():
            self.index.reset(self.wid, (), 0)
        self.seq = 0

    def apply(self, changes: list) -> bool:
        """`changes` are vllm_translate.Change; False when the index dropped this worker."""
        if self.paused():
            return True
        events = [KVEvent(self.seq + i + 1, c.kind, c.hashes, medium=c.medium) for i, c in enumerate(changes)]
        self.seq += len(changes)
        return self.index.apply(EventBatch(self.wid, events, self.seq)) != RESYNC


class VllmKind:
    """Adds vLLM workers to a Fleet: `Fleet(kinds={"vllm": VllmKind(...)})`. `block_size` is the
    gateway's (its hashes); `profile` the cost model of every vLLM worker (`kvgate calibrate`)."""

    def __init__(self, block_size: int = 16, profile: dict | None = None, needs_cost: bool = False):
        self.block_size = block_size
        self.profile = profile
        self.needs_cost = needs_cost
        self.specs: dict[str, Spec] = {}
        self.links: dict[str, FleetLink] = {}

    def add(self, spec: Spec) -> str:
        """Remember a worker's options; returns the URL to `Fleet.add` it under."""
        self.specs[spec.url] = spec
        return spec.url

    def spawn(self, fleet, w) -> list[asyncio.Task]:
        link = self.links[w.url] = FleetLink(self, fleet, w, self.specs.get(w.url, Spec(w.url)))
        return [asyncio.create_task(link.run())]

    def collect(self):
        """Prometheus families of the event path, per vLLM worker (a collector of the gateway's
        registry: gateway/metrics.py)."""
        fams = {
            name: CounterMetricFamily(f"kvgate_gateway_vllm_event_{name}", doc, labels=labels)
            for name, doc, labels in COUNTERS
        }
        lag = GaugeMetricFamily(
            "kvgate_gateway_vllm_event_lag_seconds",
            "Median delay from a KV event batch's publication to its arrival, recent batches",
            labels=["worker"],
        )
        for link in list(self.links.values()):
            sub, tr = link.stats or (None, None)
            w = [link.wid]
            fams["batches"].add_metric(w, sub.batches if sub else 0)
            fams["resyncs"].add_metric(w, sub.syncs if sub else 0)
            fams["gaps"].add_metric(w, sub.gaps if sub else 0)
            fams["restarts"].add_metric(w, sub.restarts if sub else 0)
            fams["bad_batches"].add_metric(w, sub.bad_batches if sub else 0)
            fams["bad_events"].add_metric(w, sub.bad_events if sub else 0)
            for outcome in ("stored", "removed", "skipped"):
                fams["blocks"].add_metric(w + [outcome], getattr(tr, f"{outcome}_blocks") if tr else 0)
            if sub and sub.lag_s:
                lag.add_metric(w, sorted(sub.lag_s)[len(sub.lag_s) // 2])
        yield from fams.values()
        yield lag


class FleetLink(VllmLink):
    def __init__(self, kind: VllmKind, fleet, w, spec: Spec):
        super().__init__(w.url, kind.block_size, fleet.interval, fleet.timeout, spec.source(), kind.profile)
        self.kind, self.fleet, self.w = kind, fleet, w
        self.warned = False

    def up(self, state: dict) -> None:
        self.fleet.up(self.w, state)
        self.w.hash_ratio = max(1, state["block_size"] // self.block_size)
        if not self.warned:
            self.warn(state["block_size"])
        self.warned = True
        if not self.w.static and not self.w.redis_residency:
            self.fleet.index.drop(self.wid)  # found through Redis, which is down: cache-blind until it is back

    def warn(self, block_size: int) -> None:
        """Say once what keeps this worker's routing from being as good as a kvgate worker's."""
        if block_size % self.block_size:
            log.warning(
                "vLLM worker %s caches blocks of %d tokens, which the gateway's --block-size %d does "
                "not divide: its residency cannot be indexed, it is routed cache-blind",
                self.wid,
                block_size,
                self.block_size,
            )
        if self.kind.needs_cost and self.profile is None:
            log.warning(
                "vLLM worker %s has no cost model: slo_goodput predicts its TTFT and TPOT with the "
                "default model; measure one with `kvgate calibrate --url %s --out P.json` and pass "
                "--vllm-profile P.json",
                self.wid,
                self.url,
            )

    def down(self, why: str) -> None:
        self.fleet.down(self.w, why)

    def restarted(self) -> None:
        self.fleet.index.drop(self.wid)

    def following(self) -> bool:
        """A `--worker`'s events are followed unless Redis carries them; a worker found in Redis
        has a bridge, and gateway replicas open no ZMQ of their own."""
        return self.w.healthy and self.w.static and not self.w.redis_residency

    def sink(self) -> IndexSink:
        return IndexSink(self.fleet.index, self.wid, lambda: self.w.redis_residency)
