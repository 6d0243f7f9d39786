"""OpenTelemetry traces of the gateway's requests.

One server span per request, carrying the routing decision's facts (model, policy, worker,
prefill worker, predicted and actual cached tokens, TTFT) as attributes, with child spans for
the phases that take time: `tokenize`, `route`, `upstream` (until the worker's response head)
and, for P/D, `prefill_leg`. A client's W3C `traceparent` is continued and the gateway's own
is passed to the worker, so one trace crosses both hops.

Off by default. Off, `Tracing.start` hands out one shared no-op trace, so a request allocates
no span and pays a method call per phase.
"""
import contextlib
from collections.abc import Iterator, Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

EXPORTERS = ("none", "console", "otlp")
PROPAGATOR = TraceContextTextMapPropagator()


def make_exporter(name: str, endpoint: str | None = None) -> SpanExporter | None:
    """The span exporter a `--trace` choice names. `otlp` speaks OTLP over HTTP (protobuf) to
    `endpoint` (a collector's base URL, e.g. http://127.0.0.1:4318) or, without one, to where
    the standard OTEL_EXPORTER_OTLP_* variables say."""
    if name == "none":
        return None
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"unknown trace exporter {name!r}; choose one of {', '.join(EXPORTERS)}")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise ValueError("--trace otlp needs the OTLP exporter: pip install 'kvgate[otlp]'") from e
    return OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces" if endpoint else None)


class RequestTrace:
    """The spans of one request: the server span and its phases."""

    def __init__(self, tracer: trace.Tracer, span: trace.Span):
        self.tracer, self.span = tracer, span
        self.context = trace.set_span_in_context(span)

    def set(self, **attributes: str | int | float | None) -> None:
        """Attributes of the request span, named `kvgate.<key>`; None values are left out."""
        self.span.set_attributes({f"kvgate.{k}": v for k, v in attributes.items() if v is not None})

    @contextlib.contextmanager
    def phase(self, name: str, **attributes: str | int | float) -> Iterator[None]:
        """A child span around a phase; an exception escaping it marks the phase failed."""
        with self.tracer.start_as_current_span(name, context=self.context, attributes=attributes,
                                               end_on_exit=True):
            yield

    def child(self, name: str, **attributes: str | int | float) -> trace.Span:
        """A child span its caller ends, for work that outlives the call (a prefill leg)."""
        return self.tracer.start_span(name, context=self.context, attributes=attributes)

    def inject(self, headers: dict[str, str]) -> None:
        """Add `traceparent` so the worker's work joins this trace."""
        PROPAGATOR.inject(headers, context=self.context)

    def end(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()


class NoTrace(RequestTrace):
    """What a request gets while tracing is off: every call does nothing."""

    def __init__(self):
        pass

    def set(self, **attributes: str | int | float | None) -> None:
        pass

    @contextlib.contextmanager
    def phase(self, name: str, **attributes: str | int | float) -> Iterator[None]:
        yield

    def child(self, name: str, **attributes: str | int | float) -> trace.Span:
        return trace.INVALID_SPAN

    def inject(self, headers: dict[str, str]) -> None:
        pass

    def end(self, status: int) -> None:
        pass


NO_TRACE = NoTrace()


class Tracing:
    """The gateway's tracer: spans go to `exporter` in batches, from a background thread, for
    the `sample_ratio` of traces not already decided by the client's sampled flag."""

    def __init__(self, exporter: SpanExporter | None = None, sample_ratio: float = 1.0,
                 service: str = "kvgate-gateway"):
        self.provider: TracerProvider | None = None
        self.tracer: trace.Tracer | None = None
        if exporter is not None:
            self.provider = TracerProvider(resource=Resource.create({"service.name": service}),
                                           sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
            self.tracer = self.provider.get_tracer("kvgate.gateway")

    def start(self, name: str, headers: Mapping[str, str]) -> RequestTrace:
        """The server span of a request, continuing the client's trace if it sent one."""
        if self.tracer is None:
            return NO_TRACE
        span = self.tracer.start_span(name, context=PROPAGATOR.extract(headers), kind=SpanKind.SERVER)
        return RequestTrace(self.tracer, span)

    def shutdown(self) -> None:
        """Flush the spans still queued."""
        if self.provider is not None:
            self.provider.shutdown()
