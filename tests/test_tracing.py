"""OpenTelemetry traces: spans and propagation in process, and a real gateway exporting OTLP to a
test collector."""
import http.server
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.tracing import NO_TRACE, Tracing, make_exporter
from tests.procs import Worker, start_gateway, stop_all, wait_for

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


def test_request_spans_continue_the_client_trace_and_propagate():
    exporter = InMemorySpanExporter()
    tracing = Tracing(exporter)
    t = tracing.start("POST /v1/completions", {"traceparent": CLIENT_PARENT})
    with t.phase("route"):
        pass
    leg = t.child("prefill_leg", worker="p0")
    leg.end()
    headers: dict[str, str] = {}
    t.inject(headers)
    t.set(worker="w1", cached_tokens=None, prompt_tokens=40)
    t.end(200)
    tracing.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["POST /v1/completions"]
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert root.parent.span_id == 0x00f067aa0ba902b7
    assert spans["route"].parent.span_id == root.context.span_id
    assert spans["prefill_leg"].parent.span_id == root.context.span_id
    assert root.attributes["kvgate.worker"] == "w1" and "kvgate.cached_tokens" not in root.attributes
    assert root.attributes["http.response.status_code"] == 200
    assert headers["traceparent"].split("-")[1] == CLIENT_TRACE
    assert headers["traceparent"].split("-")[2] == format(root.context.span_id, "016x")


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
    """An OTLP/HTTP trace receiver on a free loopback port that keeps what it is sent."""

    def __init__(self):
        self.spans: list = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(handler):
                body = handler.rfile.read(int(handler.headers["content-length"]))
                req = ExportTraceServiceRequest.FromString(body)
                self.spans += [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
                handler.send_response(200)
                handler.send_header("content-type", "application/x-protobuf")
                handler.end_headers()

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.mark.slow
def test_gateway_exports_request_traces_over_otlp(monkeypatch, tmp_path):
    collector = Collector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    worker = Worker(worker_id="t0", log_dir=str(tmp_path))
    gateway = start_gateway([worker.url], "prefix_affinity", log_dir=str(tmp_path),
                            extra=["--trace", "otlp", "--trace-endpoint", collector.url])
    try:
        worker.ready()
        gateway.wait_ready()
        r = httpx.post(gateway.url + "/v1/completions", timeout=30, headers={"traceparent": CLIENT_PARENT},
                       json={"prompt": "a traced request", "max_tokens": 4, "stream": True})
        assert r.status_code == 200
        assert httpx.post(gateway.url + "/v1/completions", json={"prompt": 3}, timeout=30).status_code == 400
        wait_for(lambda: len({s.trace_id for s in collector.spans if s.kind == s.SPAN_KIND_SERVER}) >= 2,
                 timeout=10)
    finally:
        stop_all([gateway, worker])
        collector.shutdown()
    traced = [s for s in collector.spans if s.trace_id.hex() == CLIENT_TRACE]
    root = next(s for s in traced if s.kind == s.SPAN_KIND_SERVER)
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["kvgate.worker"].string_value == "t0" == r.headers["x-kvgate-worker"]
    assert attrs["kvgate.model"].string_value == "smollm2-135m"
    assert attrs["http.response.status_code"].int_value == 200
    assert attrs["kvgate.ttft_ms"].double_value > 0
    phases = {s.name for s in traced if s.parent_span_id == root.span_id}
    assert {"tokenize", "route", "upstream"} <= phases
    bad = next(s for s in collector.spans if s.kind == s.SPAN_KIND_SERVER and s.trace_id.hex() != CLIENT_TRACE)
    assert {a.key: a.value for a in bad.attributes}["http.response.status_code"].int_value == 400
    assert time.time_ns() >= root.end_time_unix_nano >= root.start_time_unix_nano
