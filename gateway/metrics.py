"""Prometheus metrics of the gateway: traffic and SLO outcomes, latencies as clients see them,
decision cost, routing quality, fleet state. Every request series carries `model` (and
`worker` where one served it).

Each gateway has its own registry (several gateways may live in one test process); fleet
gauges are read from the registry objects at scrape time rather than kept in sync. Labelled
counters start at 0 for every known label value (each worker and model the fleet knows, each
status, stage and outcome) before the first scrape that could see them move, so `rate()` sees
the first failure of an incident, not only the second.
"""

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.record import PREFILL, SLO_OUTCOMES, WHOLE, DECODE, RequestRecord, slo_outcome
from workers.metrics import FINISH_REASONS, LATENCY_BUCKETS, TOKEN_BUCKETS
from workers.process_metrics import register_process_metrics

if TYPE_CHECKING:
    from gateway.redis_state import RedisState

DECISION_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3)
STATUSES = ("200", "400", "404", "413", "429", "499", "500", "502", "503", "504")
STAGES = ("connect", "timeout", "lost", "response", "error_event", "busy", "stream")
REFUSALS = ("overloaded", "draining", "worker_queues_full", "policy")
LEGS = (WHOLE, PREFILL, DECODE)


class FleetCollector:
    def __init__(self, fleet):
        self.fleet = fleet

    def collect(self):
        healthy = GaugeMetricFamily(
            "kvgate_gateway_worker_healthy", "1 when the worker is a candidate", labels=["model", "worker", "url"]
        )
        flight = GaugeMetricFamily(
            "kvgate_gateway_in_flight", "Requests this gateway has open on a worker", labels=["model", "worker"]
        )
        shared = GaugeMetricFamily(
            "kvgate_gateway_shared_in_flight",
            "Requests other gateway replicas have open on a worker (via Redis)",
            labels=["model", "worker"],
        )
        ledger = GaugeMetricFamily(
            "kvgate_gateway_ledger_requests",
            "Requests in this gateway's ledger of a worker, every replica's: equal to in_flight plus "
            "shared_in_flight where the ledger prices the worker's pool wait",
            labels=["model", "worker"],
        )
        blocks = GaugeMetricFamily(
            "kvgate_gateway_resident_blocks", "Blocks the residency index holds per worker", labels=["model", "worker"]
        )
        lag = GaugeMetricFamily(
            "kvgate_gateway_index_lag_events",
            "KV events the worker reported at its last poll that the index has not applied",
            labels=["model", "worker"],
        )
        probes = CounterMetricFamily(
            "kvgate_gateway_worker_probe_failures",
            "Failed /state polls: the worker unreachable or not answering",
            labels=["model", "worker", "url"],
        )
        malformed = CounterMetricFamily(
            "kvgate_gateway_worker_malformed_kv",
            "KV-event lines and snapshots from the worker dropped as malformed (its residency resynced)",
            labels=["model", "worker", "url"],
        )
        index = self.fleet.index
        for w in list(self.fleet.workers.values()):
            wid, model = w.worker_id or "", w.model or ""
            healthy.add_metric([model, wid, w.url], 1.0 if w.available else 0.0)
            flight.add_metric([model, wid], w.in_flight)
            shared.add_metric([model, wid], w.shared_in_flight)
            ledger.add_metric([model, wid], len(w.ledger))
            blocks.add_metric([model, wid], index.num_blocks(wid) if wid else 0)
            probes.add_metric([model, wid, w.url], w.probe_failures)
            malformed.add_metric([model, wid, w.url], w.malformed_kv)
            if wid and w.healthy and "kv_seq" in w.state:  # a worker that is down has no index to lag
                lag.add_metric([model, wid], max(0, w.state["kv_seq"] - (index.seq(wid) or 0)))
        yield from (healthy, flight, shared, ledger, blocks, lag, probes, malformed)


class RedisCollector:
    """What an operator needs to see of a gateway's Redis: whether it routes on it (else the
    embedded path: residency from the workers, no load shared between replicas), what it
    refused to read, and how many other replicas it hears from. Read from the RedisState at
    scrape time."""

    def __init__(self, state: "RedisState"):
        self.state = state

    def collect(self):
        s = self.state
        up = GaugeMetricFamily(
            "kvgate_gateway_redis_up",
            "1 while residency, discovery and shared load come from Redis; 0 on the embedded path",
        )
        up.add_metric([], 1.0 if s.up else 0.0)
        bad = CounterMetricFamily(
            "kvgate_gateway_redis_malformed",
            "What this gateway read from Redis and dropped as malformed: another replica's shared "
            "line (share_line) or in-flight table (inflight_table), a KV-event stream entry "
            "(event_entry), a worker's resident sets (resident_set)",
            labels=["what"],
        )
        for what, n in s.malformed.items():
            bad.add_metric([what], n)
        refused = GaugeMetricFamily(
            "kvgate_gateway_redis_rejected_registrations",
            "Registrations in Redis this gateway ignored at its last read of the registry (unsigned, "
            "signed with another token or for another worker, not an http(s) URL): they get no requests",
        )
        refused.add_metric([], s.ignored)
        replicas = GaugeMetricFamily(
            "kvgate_gateway_redis_replicas", "Other gateway replicas whose in-flight load this one reads from Redis"
        )
        replicas.add_metric([], len(s.share.tables))
        yield from (up, bad, refused, replicas)


class GatewayMetrics:
    def __init__(self, fleet, policy: str = ""):
        self.fleet, self.policy = fleet, policy
        self.registry = r = CollectorRegistry()
        wm = ["model", "worker"]
        self.requests = Counter(
            "kvgate_gateway_requests",
            "Requests answered, by model, worker, policy and status",
            ["model", "worker", "policy", "status"],
            registry=r,
        )
        self.slo = Counter(
            "kvgate_gateway_slo_requests",
            "Requests by outcome against their TTFT/TPOT SLOs (met, ttft_miss, tpot_miss; "
            "rejected: shed with 429/503; failed: a server error)",
            ["model", "outcome"],
            registry=r,
        )
        self.decision = Histogram(
            "kvgate_gateway_decision_seconds",
            "Routing decision time (match + policy)",
            ["policy"],
            buckets=DECISION_BUCKETS,
            registry=r,
        ).labels(policy)
        quality = ["model", "worker", "policy", "leg"]
        self.predicted_cached = Counter(
            "kvgate_gateway_predicted_cached_tokens",
            "Prompt tokens the gateway expected the worker to have cached, by leg "
            "(whole request, P/D prefill, P/D decode)",
            quality,
            registry=r,
        )
        self.actual_cached = Counter(
            "kvgate_gateway_actual_cached_tokens",
            "Prompt tokens the worker reported as cached, by leg",
            quality,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvgate_gateway_prompt_tokens", "Prompt tokens of answered requests, by leg", quality, registry=r
        )
        self.generation_tokens = Counter(
            "kvgate_gateway_generation_tokens", "Output tokens of answered requests", wm, registry=r
        )
        self.ttft = Histogram(
            "kvgate_gateway_time_to_first_token_seconds",
            "Arrival at the gateway to the first token (streaming or not)",
            wm,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvgate_gateway_time_per_output_token_seconds",
            "A request's mean time per output token after the first",
            wm,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvgate_gateway_e2e_request_latency_seconds",
            "Arrival at the gateway to the answer's last byte, answered requests",
            wm,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_prompt = Histogram(
            "kvgate_gateway_request_prompt_tokens",
            "Prompt tokens per request",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_output = Histogram(
            "kvgate_gateway_request_generation_tokens",
            "Output tokens per request",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_cached = Histogram(
            "kvgate_gateway_request_cached_tokens",
            "Cached prompt tokens per request",
            ["model"],
            buckets=(0, *TOKEN_BUCKETS),
            registry=r,
        )
        self.finished = Counter(
            "kvgate_gateway_requests_finished",
            "Answered requests by finish reason",
            ["model", "finished_reason"],
            registry=r,
        )
        self.upstream_failures = Counter(
            "kvgate_gateway_upstream_failures",
            "Worker failures: before the response (retried) or mid-response",
            ["model", "worker", "stage"],
            registry=r,
        )
        self.retries = Counter(
            "kvgate_gateway_retries", "Requests sent to another worker after a failure, by stage", ["stage"], registry=r
        )
        self.refused = Counter(
            "kvgate_gateway_refused", "Requests refused by admission control, by reason", ["reason"], registry=r
        )
        self.prefill_legs = Counter(
            "kvgate_gateway_prefill_legs",
            "P/D prefill legs, by prefill worker and outcome",
            ["model", "worker", "outcome"],
            registry=r,
        )
        r.register(FleetCollector(fleet))
        for kind in getattr(fleet, "kinds", {}).values():  # other engines' collectors (gateway/vllm_worker.py)
            r.register(kind)
        register_process_metrics(r, "gateway")
        for stage in STAGES:
            self.retries.labels(stage)
        for reason in REFUSALS:
            self.refused.labels(reason)
        self._known: set[tuple[str, str]] = set()
        self._children: dict[tuple, Any] = {}
        self.know("", "")

    def know(self, model: str, worker: str) -> None:
        """Start every labelled counter of (model, worker) at 0."""
        if (model, worker) in self._known:
            return
        self._known.add((model, worker))
        for status in STATUSES:
            self.requests.labels(model, worker, self.policy, status)
        if not worker:
            return
        for stage in STAGES:
            self.upstream_failures.labels(model, worker, stage)
        for outcome in ("ok", "failed"):
            self.prefill_legs.labels(model, worker, outcome)
        for leg in LEGS:
            for c in (self.predicted_cached, self.actual_cached, self.prompt_tokens):
                c.labels(model, worker, self.policy, leg)
        self.generation_tokens.labels(model, worker)
        if (model, "") not in self._known:
            self.know(model, "")
            for outcome in SLO_OUTCOMES:
                self.slo.labels(model, outcome)
            for reason in FINISH_REASONS:
                self.finished.labels(model, reason)

    def sync(self) -> None:
        """`know` every worker the fleet has identified."""
        for w in list(self.fleet.workers.values()):
            if w.worker_id and w.model:
                self.know(w.model, w.worker_id)

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: prometheus_client validates the values and takes a
        lock on every `labels` call, about a dozen of them per request. Holds no label set the
        metric does not hold already."""
        key = (metric, labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def observe(self, rec: RequestRecord) -> None:
        """Account an ended request: its status and SLO outcome, and for an answer its latencies,
        tokens and cache hit."""
        model, worker, child = rec.model, rec.worker, self.child
        child(self.requests, model, worker, self.policy, str(rec.status)).inc()
        outcome = slo_outcome(rec)
        if outcome is not None:
            child(self.slo, model, outcome).inc()
        if rec.status != 200 or not worker:
            return
        if rec.ttft_s is not None:
            child(self.ttft, model, worker).observe(rec.ttft_s)
        if rec.tpot_s is not None:
            child(self.tpot, model, worker).observe(rec.tpot_s)
        if rec.e2e_s is not None:
            child(self.e2e, model, worker).observe(rec.e2e_s)
        if rec.finish_reason is not None:
            child(self.finished, model, rec.finish_reason).inc()
        if rec.output_tokens is not None:
            child(self.request_output, model).observe(rec.output_tokens)
            child(self.generation_tokens, model, worker).inc(rec.output_tokens)
        if rec.prompt_tokens is not None:
            child(self.request_prompt, model).observe(rec.prompt_tokens)
        if rec.cached_tokens is not None:
            child(self.request_cached, model).observe(rec.cached_tokens)
            self.hit(model, worker, rec.leg, rec.prompt_tokens or 0, rec.predicted_cached or 0, rec.cached_tokens)

    def hit(self, model: str, worker: str, leg: str, prompt: int, predicted: int, actual: int) -> None:
        """Routing quality: what one leg was expected to find cached, and found."""
        labels = (model, worker, self.policy, leg)
        self.child(self.prompt_tokens, *labels).inc(prompt)
        self.child(self.predicted_cached, *labels).inc(predicted)
        self.child(self.actual_cached, *labels).inc(actual)

    def render(self) -> tuple[bytes, str]:
        self.sync()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
