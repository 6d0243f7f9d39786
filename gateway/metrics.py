"""Prometheus metrics of the gateway: traffic, decision cost, prediction quality, fleet state.

Each gateway has its own registry (several gateways may live in one test process); fleet
gauges are read from the registry objects at scrape time rather than kept in sync.
"""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

DECISION_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _FleetCollector:
    def __init__(self, fleet):
        self.fleet = fleet

    def collect(self):
        healthy = GaugeMetricFamily("kvgate_gateway_worker_healthy", "1 when the worker is a candidate",
                                    labels=["worker", "url"])
        flight = GaugeMetricFamily("kvgate_gateway_in_flight", "Requests this gateway has open on a worker",
                                   labels=["worker"])
        shared = GaugeMetricFamily("kvgate_gateway_shared_in_flight",
                                   "Requests other gateway replicas have open on a worker (via Redis)",
                                   labels=["worker"])
        blocks = GaugeMetricFamily("kvgate_gateway_resident_blocks",
                                   "Blocks the residency index holds per worker", labels=["worker"])
        for w in list(self.fleet.workers.values()):
            wid = w.worker_id or ""
            healthy.add_metric([wid, w.url], 1.0 if w.available else 0.0)
            flight.add_metric([wid], w.in_flight)
            shared.add_metric([wid], w.shared_in_flight)
            blocks.add_metric([wid], self.fleet.index.num_blocks(wid) if wid else 0)
        yield from (healthy, flight, shared, blocks)


class GatewayMetrics:
    def __init__(self, fleet):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvgate_gateway_requests", "Requests answered, by worker, policy and status",
                                ["worker", "policy", "status"], registry=r)
        self.decision = Histogram("kvgate_gateway_decision_seconds", "Routing decision time (match + policy)",
                                  buckets=DECISION_BUCKETS, registry=r)
        self.predicted_cached = Counter("kvgate_gateway_predicted_cached_tokens",
                                        "Prompt tokens the policy expected the worker to have cached",
                                        ["worker"], registry=r)
        self.actual_cached = Counter("kvgate_gateway_actual_cached_tokens",
                                     "Prompt tokens the worker reported as cached", ["worker"], registry=r)
        self.prompt_tokens = Counter("kvgate_gateway_prompt_tokens", "Prompt tokens routed", ["worker"],
                                     registry=r)
        self.ttft = Histogram("kvgate_gateway_ttft_seconds", "Time to first token seen at the gateway",
                              ["worker"], buckets=TTFT_BUCKETS, registry=r)
        self.upstream_failures = Counter("kvgate_gateway_upstream_failures",
                                         "Worker failures: before the response (retried) or mid-response",
                                         ["worker", "stage"], registry=r)
        self.retries = Counter("kvgate_gateway_retries", "Requests sent to another worker after a failure, by stage",
                               ["stage"], registry=r)
        self.refused = Counter("kvgate_gateway_refused", "Requests refused by admission control, by reason",
                               ["reason"], registry=r)
        self.prefill_legs = Counter("kvgate_gateway_prefill_legs", "P/D prefill legs, by prefill worker and outcome",
                                    ["worker", "outcome"], registry=r)
        r.register(_FleetCollector(fleet))
        for kind in getattr(fleet, "kinds", {}).values():  # other engines' collectors (gateway/vllm_worker.py)
            r.register(kind)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
