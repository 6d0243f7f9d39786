"""Prometheus metrics of one worker, named after vLLM's where the meaning is the same (the
README's table maps them). Every series carries `model` and `worker`.

Engine counters and gauges are read from the engine at scrape time, the step-time histogram
from the engine's plain counts (its thread takes no metrics lock). Request latencies are
observed on the server's event loop as outputs arrive: TTFT and end-to-end from the HTTP
arrival, inter-token latency between outputs, TPOT per request, and the engine's own queue,
prefill and decode intervals. Labelled counters start at 0 for every known label value, so the
first failure shows in `rate()`.
"""

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from workers.outputs import RequestOutput
from workers.process_metrics import register_process_metrics
from workers.step_stats import STEP_BUCKETS

# request latencies (s): fine from 5 to 250 ms, where TTFT/TPOT SLOs sit, coarse beyond
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.06,
    0.075,
    0.1,
    0.125,
    0.15,
    0.175,
    0.2,
    0.25,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("engine_stopped", "draining", "overloaded")
LABELS = ("model", "worker")


@dataclass
class RequestClock:
    """A request's times on the server's loop (time.monotonic()): HTTP arrival, first and
    last output carrying tokens."""

    arrived: float
    first: float | None = None
    last: float | None = None


class _EngineCollector:
    def __init__(self, engine, model: str):
        self.engine, self.labels = engine, [model, engine.worker_id]

    def collect(self):
        st, s, eng = self.engine.stats, self.engine.state(), self.engine
        counters = {
            "kvgate_worker_prompt_tokens": ("Prompt tokens of started requests", st.prompt_tokens),
            "kvgate_worker_cached_tokens": ("Prompt tokens served from the prefix cache", st.cached_tokens),
            "kvgate_worker_generation_tokens": ("Generated tokens", st.generated_tokens),
            "kvgate_worker_preemptions": ("Requests preempted by recompute", st.preemptions),
            "kvgate_worker_requests_failed": ("Requests failed by an engine fault", st.failed),
            "kvgate_worker_steps": ("Engine steps", st.steps),
            "kvgate_worker_kv_arrived": ("P/D decode requests whose blocks arrived in time", st.kv_arrived),
            "kvgate_worker_kv_fallbacks": ("P/D decode requests that computed their own prefill", st.kv_fallbacks),
            "kvgate_worker_kv_imported_blocks": ("KV blocks imported into the prefix cache", st.kv_imported_blocks),
            "kvgate_worker_kv_exported_blocks": ("KV blocks exported to decode workers", st.kv_exported_blocks),
            "kvgate_worker_host_kv_stored_blocks": (
                "KV blocks evicted from the device and copied to the host tier",
                st.host_stored_blocks,
            ),
            "kvgate_worker_host_kv_loaded_blocks": (
                "KV blocks copied back from the host tier for a prefix hit",
                st.host_loaded_blocks,
            ),
            "kvgate_worker_disk_kv_stored_blocks": ("KV blocks written to the disk tier", st.disk_stored_blocks),
            "kvgate_worker_disk_kv_loaded_blocks": (
                "KV blocks read back from the disk tier for a prefix hit",
                st.disk_loaded_blocks,
            ),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self.labels, value)
            yield c
        total = s.total_blocks
        gauges = {
            "kvgate_worker_requests_running": ("Requests in the running batch", s.running),
            "kvgate_worker_requests_waiting": ("Requests waiting for admission", s.waiting),
            "kvgate_worker_requests_pending_kv": ("P/D decode requests waiting for their KV blocks", s.pending_kv),
            "kvgate_worker_kv_cache_usage_perc": (
                "KV cache usage, 0 to 1: blocks held by requests (cached-but-free blocks count as free)",
                1.0 - s.free_blocks / total if total else 0.0,
            ),
            "kvgate_worker_kv_cache_free_blocks": ("Free KV blocks (incl. cached-but-free)", s.free_blocks),
            "kvgate_worker_kv_cache_blocks": ("KV blocks in the pool", total),
            "kvgate_worker_host_kv_cache_blocks": ("Blocks of the host KV tier (0: none)", s.host_blocks),
            "kvgate_worker_host_kv_cache_free_blocks": (
                "Host KV tier blocks holding no block's K/V",
                s.host_free_blocks,
            ),
            "kvgate_worker_disk_kv_cache_blocks": ("Blocks of the disk KV tier (0: none)", s.disk_blocks),
            "kvgate_worker_disk_kv_cache_free_blocks": ("Disk KV tier blocks holding no block", s.disk_free_blocks),
            "kvgate_worker_queued_prefill_tokens": ("Prompt tokens not yet computed", s.queued_prefill_tokens),
            "kvgate_worker_engine_alive": ("1 while the engine thread runs", float(eng.alive)),
            "kvgate_worker_engine_stall_seconds": (
                "Seconds without a completed step while there is work",
                eng.stall_s(),
            ),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self.labels, value)
            yield g
        yield self._steps(st)

    def _steps(self, st) -> HistogramMetricFamily:
        h = HistogramMetricFamily(
            "kvgate_worker_step_duration_seconds",
            "Executor (device) time of an engine step; an idle worker adds none",
            labels=LABELS,
        )
        cumulative, buckets = 0, []
        for bound, n in zip((*STEP_BUCKETS, float("inf")), list(st.step_counts)):
            cumulative += n
            buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
        h.add_metric(self.labels, buckets, st.step_seconds)
        return h


class WorkerMetrics:
    def __init__(self, engine, model: str | None = None):
        model = model or engine.config.model_id
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine, model))
        register_process_metrics(r, "worker")
        labels = (model, engine.worker_id)

        def hist(name: str, doc: str, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*labels)

        self.ttft = hist("kvgate_worker_time_to_first_token_seconds", "Time to first token, from HTTP arrival")
        self.itl = hist("kvgate_worker_inter_token_latency_seconds", "Time between a request's outputs, per token")
        self.tpot = hist(
            "kvgate_worker_request_time_per_output_token_seconds",
            "A request's mean time per output token after the first",
        )
        self.e2e = hist("kvgate_worker_e2e_request_latency_seconds", "Request latency, HTTP arrival to last token")
        self.queue = hist(
            "kvgate_worker_request_queue_time_seconds",
            "Time waiting in the engine before first scheduled (incl. a P/D decode leg's KV wait)",
        )
        self.prefill = hist("kvgate_worker_request_prefill_time_seconds", "First scheduled to first token")
        self.decode = hist("kvgate_worker_request_decode_time_seconds", "First token to last token")
        self.prompt_tokens = hist("kvgate_worker_request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.generation_tokens = hist(
            "kvgate_worker_request_generation_tokens", "Output tokens per request", TOKEN_BUCKETS
        )
        finished = Counter(
            "kvgate_worker_requests_finished",
            "Requests ended, by finish reason",
            [*LABELS, "finished_reason"],
            registry=r,
        )
        self.finished = {reason: finished.labels(*labels, reason) for reason in FINISH_REASONS}
        rejected = Counter(
            "kvgate_worker_requests_rejected", "Requests refused with a 503, by reason", [*LABELS, "reason"], registry=r
        )
        self.rejected = {reason: rejected.labels(*labels, reason) for reason in REJECT_REASONS}
        tokenized = Counter(
            "kvgate_worker_prompts_tokenized",
            "Text prompts by who tokenized them: the gateway (its ids used here) or this worker",
            [*LABELS, "by"],
            registry=r,
        )
        self.tokenized = {by: tokenized.labels(*labels, by) for by in ("gateway", "worker")}

    def observe(self, out: RequestOutput, clock: RequestClock) -> None:
        """Account one output of a request: latencies as its tokens arrive, the rest at its end."""
        now = time.monotonic()
        if out.token_ids:
            if clock.first is None:
                clock.first = now
                self.ttft.observe(now - clock.arrived)
            elif clock.last is not None:
                gap = (now - clock.last) / len(out.token_ids)
                for _ in out.token_ids:
                    self.itl.observe(gap)
            clock.last = now
        if out.finish_reason is not None:
            self.finish(out, clock, now)

    def finish(self, out: RequestOutput, clock: RequestClock, now: float) -> None:
        self.count_finished(out)
        self.e2e.observe(now - clock.arrived)
        self.prompt_tokens.observe(out.num_prompt)
        self.generation_tokens.observe(out.num_output)
        if out.num_output > 1 and clock.first is not None and clock.last is not None:
            self.tpot.observe((clock.last - clock.first) / (out.num_output - 1))
        t = out.times
        if t is not None and t.scheduled is not None:
            self.queue.observe(t.scheduled - t.queued)
            if t.first_token is not None:
                self.prefill.observe(t.first_token - t.scheduled)
                self.decode.observe(t.finished - t.first_token)

    def count_finished(self, out: RequestOutput) -> None:
        """Count a request's end by its last output's finish reason. Alone (not by `observe`)
        for a request that ended before the engine took it in (a choice never started): it is
        in no histogram, having no prompt, token or latency of its own."""
        self.finished.get(out.finish_reason or "error", self.finished["error"]).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
