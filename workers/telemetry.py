"""OpenTelemetry set-up shared by the gateway and the workers: exporter, provider, propagation.

The standard OTEL_* environment is honoured: OTEL_TRACES_EXPORTER is the default of `--trace`,
OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the service (else the component's own
name), OTEL_TRACES_SAMPLER(_ARG) choose the sampler unless `--trace-sample-ratio` is given, and
the OTLP exporter and batch processor read their OTEL_EXPORTER_OTLP_* and OTEL_BSP_* variables.
Torch-free: the gateway imports it.
"""

import argparse
import os
import time

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
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


def make_provider(
    exporter: SpanExporter | None, service: str, sample_ratio: float | None = None
) -> TracerProvider | None:
    """A tracer provider exporting in batches from a background thread, or None without an
    exporter. The service is named by OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES when set,
    else `service`; with `sample_ratio` None the sampler is OTEL_TRACES_SAMPLER's (default:
    parent-based, always on)."""
    if exporter is None:
        return None
    resource = Resource.create({})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service}))
    sampler = ParentBased(TraceIdRatioBased(sample_ratio)) if sample_ratio is not None else None
    provider = TracerProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """--trace, --trace-endpoint, --trace-sample-ratio, defaulting to the OTEL_* environment."""
    p.add_argument(
        "--trace",
        default=os.environ.get("OTEL_TRACES_EXPORTER", "none"),
        help="OpenTelemetry traces: none, console (stdout) or otlp (OTLP/HTTP); default $OTEL_TRACES_EXPORTER or none",
    )
    p.add_argument(
        "--trace-endpoint",
        metavar="URL",
        help="OTLP/HTTP collector base URL (default: the OTEL_EXPORTER_OTLP_* variables)",
    )
    p.add_argument(
        "--trace-sample-ratio",
        type=float,
        help="share of new traces recorded (default: $OTEL_TRACES_SAMPLER, else all); "
        "a caller's sampled traceparent is always followed",
    )


def provider_from_args(args: argparse.Namespace, service: str) -> TracerProvider | None:
    """The provider `add_trace_args`' flags ask for; raises ValueError on a bad choice."""
    return make_provider(make_exporter(args.trace, args.trace_endpoint), service, args.trace_sample_ratio)


def epoch_ns(monotonic: float) -> int:
    """A `time.monotonic()` instant as the epoch nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)
