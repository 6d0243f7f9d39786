"""OpenTelemetry traces of the gateway's requests.

One server span per request, carrying the routing decision's facts (model, policy, worker,
prefill worker, predicted and actual cached tokens, TTFT) and the GenAI conventions' `gen_ai.*`
attributes, with child spans for the phases that take time: `tokenize`, `route`, and the
CLIENT spans `upstream` (until the answer is committed: a stream's first token, a whole
answer) and, for P/D, `prefill_leg`. A client's W3C `traceparent` is continued, and each
CLIENT span's context is what the worker receives, so the worker's spans are its children and
both P/D legs land in one trace (the decode leg's `upstream` links to its `prefill_leg`).

Off by default. Off, `Tracing.start` hands out one shared no-op trace, so a request allocates
no span and pays a method call per phase.
"""

import contextlib
from collections.abc import Iterator, Mapping

from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from workers.telemetry import EXPORTERS, PROPAGATOR, make_exporter, make_provider

__all__ = ["EXPORTERS", "NO_TRACE", "RequestTrace", "Tracing", "make_exporter"]


class RequestTrace:
    """The spans of one request: the server span and its phases."""

    def __init__(self, tracer: trace.Tracer, span: trace.Span):
        self.tracer, self.span = tracer, span
        self.context = trace.set_span_in_context(span)

    def set(self, **attributes: str | int | float | None) -> None:
        """Attributes of the request span, named `kvgate.<key>`; None values are left out."""
        self.span.set_attributes({f"kvgate.{k}": v for k, v in attributes.items() if v is not None})

    def set_raw(self, attributes: Mapping[str, AttributeValue | None]) -> None:
        """Attributes under their own names (`gen_ai.*`); None values are left out."""
        self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    @contextlib.contextmanager
    def phase(self, name: str, **attributes: str | int | float) -> Iterator[None]:
        """A child span around a phase; an exception escaping it marks the phase failed."""
        with self.tracer.start_as_current_span(name, context=self.context, attributes=attributes, end_on_exit=True):
            yield

    def child(self, name: str, headers: dict[str, str], **attributes: str | int | float) -> trace.Span:
        """A CLIENT span its caller ends, for a call that outlives this one (a prefill leg); its
        `traceparent` goes into `headers`, so the worker's spans are its children."""
        span = self.tracer.start_span(name, context=self.context, kind=SpanKind.CLIENT, attributes=attributes)
        PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
        return span

    @contextlib.contextmanager
    def client(
        self, name: str, headers: dict[str, str], link: trace.Span | None = None, **attributes: str | int | float
    ) -> Iterator[dict[str, str]]:
        """A CLIENT span around a call to a worker; yields `headers` plus its `traceparent`.
        `link` (a prefill leg's span) is linked, so the legs of one request find each other."""
        links = [Link(link.get_span_context())] if link is not None and link.get_span_context().is_valid else None
        with self.tracer.start_as_current_span(
            name, context=self.context, kind=SpanKind.CLIENT, links=links, attributes=attributes, end_on_exit=True
        ) as span:
            sent = dict(headers)
            PROPAGATOR.inject(sent, context=trace.set_span_in_context(span))
            yield sent

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

    def set_raw(self, attributes: Mapping[str, object]) -> None:
        pass

    def child(self, name: str, headers: dict[str, str], **attributes: str | int | float) -> trace.Span:
        return trace.INVALID_SPAN

    @contextlib.contextmanager
    def client(
        self, name: str, headers: dict[str, str], link: trace.Span | None = None, **attributes: str | int | float
    ) -> Iterator[dict[str, str]]:
        yield headers

    def end(self, status: int) -> None:
        pass


NO_TRACE = NoTrace()


class Tracing:
    """The gateway's tracer: spans go to `exporter` in batches, from a background thread, for
    the `sample_ratio` of traces not already decided by the client's sampled flag (None: as
    OTEL_TRACES_SAMPLER says, by default all); the service is OTEL_SERVICE_NAME or `service`."""

    def __init__(
        self, exporter: SpanExporter | None = None, sample_ratio: float | None = None, service: str = "kvgate-gateway"
    ):
        self.provider = make_provider(exporter, service, sample_ratio)
        self.tracer = self.provider.get_tracer("kvgate.gateway") if self.provider is not None else None

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
