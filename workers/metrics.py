"""Prometheus metrics of one worker: engine counters read at scrape time, latency histograms."""
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        st, s = self.engine.stats, self.engine.state()
        wid = self.engine.config.worker_id
        counters = {
            "kvgate_worker_prompt_tokens": ("Prompt tokens of started requests", st.prompt_tokens),
            "kvgate_worker_cached_tokens": ("Prompt tokens served from the prefix cache", st.cached_tokens),
            "kvgate_worker_generation_tokens": ("Generated tokens", st.generated_tokens),
            "kvgate_worker_preemptions": ("Requests preempted by recompute", st.preemptions),
            "kvgate_worker_requests_finished": ("Finished requests", st.finished),
            "kvgate_worker_requests_failed": ("Requests failed by an engine fault", st.failed),
            "kvgate_worker_steps": ("Engine steps", st.steps),
            "kvgate_worker_kv_arrived": ("P/D decode requests whose blocks arrived in time", st.kv_arrived),
            "kvgate_worker_kv_fallbacks": ("P/D decode requests that computed their own prefill", st.kv_fallbacks),
            "kvgate_worker_kv_imported_blocks": ("KV blocks imported into the prefix cache", st.kv_imported_blocks),
            "kvgate_worker_kv_exported_blocks": ("KV blocks exported to decode workers", st.kv_exported_blocks),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(name, doc, labels=["worker"])
            c.add_metric([wid], value)
            yield c
        gauges = {
            "kvgate_worker_requests_running": ("Requests in the running batch", s["running"]),
            "kvgate_worker_requests_waiting": ("Requests waiting for admission", s["waiting"]),
            "kvgate_worker_kv_blocks_free": ("Free KV blocks (incl. cached-but-free)", s["free_blocks"]),
            "kvgate_worker_kv_blocks_total": ("KV blocks in the pool", s["total_blocks"]),
            "kvgate_worker_queued_prefill_tokens": ("Prompt tokens not yet computed", s["queued_prefill_tokens"]),
            "kvgate_worker_step_ms": ("Mean recent step time (ms)", s["step_ms"] or 0.0),
            "kvgate_worker_engine_alive": ("1 while the engine thread runs", float(self.engine.alive)),
            "kvgate_worker_engine_stall_seconds": ("Seconds without a completed step while there is work",
                                                   self.engine.stall_s()),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=["worker"])
            g.add_metric([wid], value)
            yield g


class WorkerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("kvgate_worker_ttft_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.rejected = Counter("kvgate_worker_requests_rejected", "Requests refused with a 503, by reason",
                                ["reason"], registry=self.registry)
        self.e2e = Histogram("kvgate_worker_e2e_seconds", "Request latency, arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe(self, out, started: float) -> None:
        """Record TTFT on a request's first output and end-to-end latency on its last."""
        now = time.monotonic() - started
        if out.num_output == 1:
            self.ttft.observe(now)
        if out.finish_reason is not None:
            self.e2e.observe(now)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
