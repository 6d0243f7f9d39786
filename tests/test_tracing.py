"""OpenTelemetry traces: spans and propagation in process, and a real gateway exporting OTLP to a
test collector."""

import http.server
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.tracing import NO_TRACE, Tracing, make_exporter
from gateway.procs import Worker, start_gateway, stop_all, wait_for

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


def test_request_spans_continue_the_client_trace_and_propagate():
    exporter = InMemorySpanExporter()
    tracing = Tracing(exporter)
    t = tracing.start("POST /v1/completions", {"traceparent": CLIENT_PARENT})
    with t.phase("route"):
        pass
    leg_headers: dict[str, str] = {}
    leg = t.child("prefill_leg", leg_headers, worker="p0")
    leg.end()
    with t.client("upstream", {"x": "1"}, leg, worker="w1") as headers:
        pass
    t.set(worker="w1", cached_tokens=None, prompt_tokens=40)
    t.end(200)
    tracing.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["POST /v1/completions"]
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert root.parent.span_id == 0x00F067AA0BA902B7
    assert spans["route"].parent.span_id == root.context.span_id
    assert spans["prefill_leg"].parent.span_id == root.context.span_id
    assert root.attributes["kvgate.worker"] == "w1" and "kvgate.cached_tokens" not in root.attributes
    assert root.attributes["http.response.status_code"] == 200
    up, leg = spans["upstream"], spans["prefill_leg"]
    assert up.kind == leg.kind == SpanKind.CLIENT and up.parent.span_id == root.context.span_id
    assert headers["x"] == "1" and headers["traceparent"].split("-")[1] == CLIENT_TRACE
    assert headers["traceparent"].split("-")[2] == format(up.context.span_id, "016x"), "the worker continues upstream"
    assert leg_headers["traceparent"].split("-")[2] == format(leg.context.span_id, "016x")
    assert [link.context.span_id for link in up.links] == [leg.context.span_id]


def test_server_errors_mark_the_span_failed_and_tracing_off_records_nothing():
    exporter = InMemorySpanExporter()
    tracing = Tracing(exporter)
    tracing.start("POST /v1/completions", {}).end(502)
    tracing.shutdown()
    (span,) = exporter.get_finished_spans()
    assert not span.status.is_ok
    assert Tracing().start("POST /v1/completions", {"traceparent": CLIENT_PARENT}) is NO_TRACE


def test_unknown_exporter_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown trace exporter"):
        make_exporter("jaeger")


class Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver on a free loopback port that keeps what it is sent, each span
    with the `service.name` of the process that sent it."""

    def __init__(self):
        self.spans: list = []
        self.service: dict[bytes, str] = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(handler):
                body = handler.rfile.read(int(handler.headers["content-length"]))
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    name = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            self.service[span.span_id] = name
                            self.spans.append(span)
                handler.send_response(200)
                handler.send_header("content-type", "application/x-protobuf")
                handler.end_headers()

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


def attrs(span) -> dict:
    """A protobuf span's attributes as plain values."""
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out


@pytest.fixture
def traced_fleet(monkeypatch, tmp_path):
    """A P/D fleet (sim prefill and decode workers, slo_goodput disaggregating long prompts)
    whose gateway and workers all export OTLP to one collector; the gateway is named by
    OTEL_SERVICE_NAME."""
    collector = Collector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    trace = ["--trace", "otlp", "--trace-endpoint", collector.url]
    secret = ["--internal-token", "trace-test-token"]
    p = Worker(worker_id="tp", log_dir=str(tmp_path), extra=["--role", "prefill", *secret, *trace])
    d = Worker(worker_id="td", log_dir=str(tmp_path), extra=["--role", "decode", *secret, *trace])
    gateway = start_gateway(
        [p.url, d.url],
        "slo_goodput",
        log_dir=str(tmp_path),
        env={"OTEL_SERVICE_NAME": "edge"},
        extra=[*trace, *secret, "--pd-min-uncached-tokens", "32", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000"],
    )
    try:
        p.ready()
        d.ready()
        gateway.wait_ready()
        gateway.wait_healthy(2, what="2 workers")
        yield gateway, collector
    finally:
        stop_all([gateway, p, d])
        collector.shutdown()


@pytest.mark.slow
def test_one_trace_crosses_the_gateway_both_pd_legs_and_the_kv_transfer(traced_fleet):
    gateway, collector = traced_fleet
    prompt = [(i * 37) % 3000 + 100 for i in range(200)]
    r = httpx.post(
        gateway.url + "/v1/completions",
        timeout=60,
        headers={"traceparent": CLIENT_PARENT},
        json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "stream": True},
    )
    assert r.status_code == 200 and r.headers["x-kvgate-prefill-worker"] == "tp"
    assert (
        httpx.post(gateway.url + "/v1/completions", json={"model": "smollm2-135m", "prompt": 3}, timeout=30).status_code
        == 400
    )
    wanted = {
        "POST /v1/completions",
        "upstream",
        "prefill_leg",
        "queue",
        "prefill",
        "prefill_chunk",
        "decode",
        "kv_export",
        "kv_import",
    }

    def complete() -> bool:
        """Every span named, the rejected request's, and both workers' request spans under the
        gateway's CLIENT spans: a worker ends its request span after the stream's last byte, so
        it may be exported after everything below it."""
        traced = [s for s in collector.spans if s.trace_id.hex() == CLIENT_TRACE]
        clients = {s.span_id for s in traced if s.name in ("upstream", "prefill_leg")}
        served = {s.parent_span_id for s in traced if s.kind == s.SPAN_KIND_SERVER}
        return (
            wanted <= {s.name for s in traced}
            and len(clients) == 2
            and clients <= served
            and any(s.kind == s.SPAN_KIND_SERVER and s.trace_id.hex() != CLIENT_TRACE for s in collector.spans)
        )

    wait_for(complete, timeout=20, what="every span of the trace")
    traced = [s for s in collector.spans if s.trace_id.hex() == CLIENT_TRACE]
    by_id = {s.span_id: s for s in traced}
    service = collector.service

    def parent(s):
        return by_id.get(s.parent_span_id)

    root = next(s for s in traced if s.kind == s.SPAN_KIND_SERVER and service[s.span_id] == "edge")
    a = attrs(root)
    assert a["kvgate.worker"] == "td" and a["kvgate.prefill_worker"] == "tp" and a["kvgate.ttft_ms"] > 0
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "smollm2-135m"
    assert a["gen_ai.usage.input_tokens"] == 200 and a["gen_ai.usage.output_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a["http.response.status_code"] == 200
    assert root.parent_span_id == bytes.fromhex("00f067aa0ba902b7")
    upstream = next(s for s in traced if s.name == "upstream")
    leg = next(s for s in traced if s.name == "prefill_leg")
    assert upstream.kind == leg.kind == upstream.SPAN_KIND_CLIENT and parent(upstream) is parent(leg) is root
    assert [link.span_id for link in upstream.links] == [leg.span_id]
    # each worker continues the CLIENT span that called it
    decode_req = next(s for s in traced if s.kind == s.SPAN_KIND_SERVER and parent(s) is upstream)
    prefill_req = next(s for s in traced if s.kind == s.SPAN_KIND_SERVER and parent(s) is leg)
    assert service[decode_req.span_id] == service[prefill_req.span_id] == "kvgate-worker"
    assert attrs(decode_req)["kvgate.worker"] == "td" and attrs(prefill_req)["kvgate.worker"] == "tp"
    assert (
        attrs(prefill_req)["gen_ai.usage.output_tokens"] == 1 and attrs(decode_req)["gen_ai.usage.output_tokens"] == 6
    )
    # the engine's phases, with their token counts, as children of each worker's request span
    for req in (prefill_req, decode_req):
        phases = {s.name: s for s in traced if parent(s) is req}
        assert {"queue", "prefill", "decode"} <= set(phases)
        assert phases["queue"].end_time_unix_nano <= phases["prefill"].start_time_unix_nano + 1000
        assert phases["prefill"].end_time_unix_nano <= phases["decode"].start_time_unix_nano + 1000
        chunks = [s for s in traced if parent(s) is phases["prefill"]]
        assert chunks and all(c.name == "prefill_chunk" for c in chunks)
        computed = sum(attrs(c)["kvgate.tokens"] for c in chunks)
        p = attrs(phases["prefill"])
        assert computed == p["kvgate.prompt_tokens"] - p["kvgate.cached_tokens"] > 0
    assert (
        attrs(next(s for s in traced if parent(s) is prefill_req and s.name == "prefill"))["kvgate.cached_tokens"] == 0
    )
    assert (
        attrs(next(s for s in traced if parent(s) is decode_req and s.name == "prefill"))["kvgate.cached_tokens"] == 192
    )
    # the KV transfer between the legs: exported under the prefill request, imported by the decode worker
    export = next(s for s in traced if s.name == "kv_export")
    imported = next(s for s in traced if s.name == "kv_import")
    assert export.kind == export.SPAN_KIND_CLIENT and parent(export) is prefill_req
    assert imported.kind == imported.SPAN_KIND_SERVER and parent(imported) is export
    assert attrs(export)["kvgate.blocks"] == 12 and attrs(imported)["kvgate.imported_blocks"] == 12
    bad = next(s for s in collector.spans if s.kind == s.SPAN_KIND_SERVER and s.trace_id.hex() != CLIENT_TRACE)
    assert attrs(bad)["http.response.status_code"] == 400 and collector.service[bad.span_id] == "edge"
    assert time.time_ns() >= root.end_time_unix_nano >= root.start_time_unix_nano
