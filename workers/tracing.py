"""OpenTelemetry spans of a worker: each request's server span continues the caller's context
(the gateway's `upstream` or `prefill_leg` CLIENT span), with children for the phases the
engine went through: `queue` (incl. a P/D decode leg's wait for its KV blocks), `prefill` with
one `prefill_chunk` per chunk, and `decode`. KV transfers are a `kv_export` CLIENT span on the
prefill worker and the `kv_import` SERVER span it continues on the decode worker, so both P/D
legs and the transfer between them land in the gateway's trace.

The engine thread never touches a span: it records its times (`RequestTimes`) and the phase
spans are made from them, with those start and end times, when the request ends. Attributes
follow the OpenTelemetry GenAI conventions (`gen_ai.*`) where they have a name, and vLLM's
`gen_ai.latency.*` for the phase times. Off, `start` returns None and nothing is recorded.
"""

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from workers.outputs import RequestOutput
from workers.protocol import ParsedRequest
from workers.telemetry import PROPAGATOR, epoch_ns

OPERATION = {"chat": "chat", "completion": "text_completion"}


class WorkerTracing:
    def __init__(self, provider: TracerProvider | None = None, worker_id: str = "", model: str = ""):
        self.provider = provider
        self.tracer = provider.get_tracer("kvgate.worker") if provider is not None else None
        self.worker_id, self.model = worker_id, model

    def start(self, name: str, headers: Mapping[str, str], parsed: ParsedRequest, request_id: str) -> Span | None:
        """The server span of a request, continuing the caller's trace; None while tracing is off."""
        if self.tracer is None:
            return None
        p = parsed.params
        return self.tracer.start_span(
            name,
            context=PROPAGATOR.extract(headers),
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": OPERATION[parsed.kind],
                "gen_ai.request.model": self.model,
                "gen_ai.request.max_tokens": p.max_tokens,
                "gen_ai.request.temperature": p.temperature,
                "gen_ai.request.top_p": p.top_p,
                "gen_ai.request.id": request_id,
                "gen_ai.usage.input_tokens": len(parsed.prompt_ids),
                "kvgate.worker": self.worker_id,
                "kvgate.kv_transfer": ",".join(sorted(parsed.kv_transfer)) or "none",
            },
        )

    def finish(self, span: Span | None, out: RequestOutput) -> None:
        """End a request's span with its phases, from the times the engine recorded."""
        if span is None:
            return
        t, ctx = out.times, trace.set_span_in_context(span)
        if t is not None:
            self._phase(ctx, "queue", t.queued, t.scheduled if t.scheduled is not None else t.finished)
            if t.scheduled is not None and t.first_token is not None:
                prefill = self._phase(
                    ctx,
                    "prefill",
                    t.scheduled,
                    t.first_token,
                    {
                        "kvgate.prompt_tokens": out.num_prompt,
                        "kvgate.cached_tokens": out.num_cached,
                        "kvgate.chunks": len(t.chunks or ()),
                    },
                    close=False,
                )
                chunk_ctx = trace.set_span_in_context(prefill)
                for launched, done, tokens in t.chunks or ():
                    self._phase(chunk_ctx, "prefill_chunk", launched, done, {"kvgate.tokens": tokens})
                prefill.end(end_time=epoch_ns(t.first_token))
                self._phase(ctx, "decode", t.first_token, t.finished, {"gen_ai.usage.output_tokens": out.num_output})
                span.set_attributes(
                    {
                        "gen_ai.latency.time_in_queue": t.scheduled - t.queued,
                        "gen_ai.latency.time_to_first_token": t.first_token - t.queued,
                        "gen_ai.latency.time_in_model_decode": t.finished - t.first_token,
                    }
                )
        span.set_attributes(
            {
                "gen_ai.response.finish_reasons": [out.finish_reason or "error"],
                "gen_ai.usage.output_tokens": out.num_output,
                "gen_ai.usage.input_tokens": out.num_prompt,
                "kvgate.cached_tokens": out.num_cached,
            }
        )
        if out.error is not None:
            span.set_status(Status(StatusCode.ERROR, out.error))
        span.end()

    def end(self, span: Span | None, status: int) -> None:
        """End a request's span that ended outside the engine (its client went away)."""
        if span is not None:
            span.set_attribute("http.response.status_code", status)
            span.end()

    def _phase(
        self, ctx, name: str, start: float, end: float, attributes: dict | None = None, close: bool = True
    ) -> Span:
        """A child span from `start` to `end` (time.monotonic()); left open with `close` False."""
        span = self.tracer.start_span(name, context=ctx, start_time=epoch_ns(start), attributes=attributes)
        if close:
            span.end(end_time=epoch_ns(end))
        return span

    def export_span(
        self, parent: Span | None, url: str, blocks: int, tokens: int, headers: dict[str, str]
    ) -> Span | None:
        """A CLIENT span around shipping a prefill's blocks to `url`, injected into `headers`."""
        if self.tracer is None or parent is None:
            return None
        span = self.tracer.start_span(
            "kv_export",
            context=trace.set_span_in_context(parent),
            kind=SpanKind.CLIENT,
            attributes={
                "kvgate.blocks": blocks,
                "kvgate.tokens": tokens,
                "server.address": url,
                "kvgate.worker": self.worker_id,
            },
        )
        PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
        return span

    def import_span(self, headers: Mapping[str, str]) -> Span | None:
        """The SERVER span of a KV import, continuing the exporter's `kv_export` span."""
        if self.tracer is None:
            return None
        return self.tracer.start_span(
            "kv_import",
            context=PROPAGATOR.extract(headers),
            kind=SpanKind.SERVER,
            attributes={"kvgate.worker": self.worker_id},
        )

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
