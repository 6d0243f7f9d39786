"""The end of a request at the gateway, in one place: its metrics, its access-log line and its
trace's closing attributes; and the periodic fleet summary line.

Both log lines go through loggers of their own (`kvgate.access`, `kvgate.fleet`) at INFO,
whatever `--log-level` is, with structured fields (workers/logs.py renders them as
`key=value` or JSON keys). Either can be turned off.
"""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from gateway.metrics import GatewayMetrics
from gateway.record import FAILED, MET, RequestRecord, slo_outcome

access_log = logging.getLogger("kvgate.access")
fleet_log = logging.getLogger("kvgate.fleet")
OPERATION = {"chat": "chat", "completion": "text_completion", "embeddings": "embeddings"}  # OpenTelemetry's names
# What the request series and SLO outcomes count: generation. They have no endpoint label, so the
# forwarded endpoints (gateway/forward.py: /tokenize, /detokenize, /v1/embeddings) stay out of them;
# a Responses API create the gateway serves as a chat (`RequestRecord.generation`) is counted in.
GENERATION = frozenset({"chat", "completion"})


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def access_fields(rec: RequestRecord, outcome: str | None) -> dict:
    """The access-log line of a request (None fields are left out of it)."""
    return {
        "request_id": rec.request_id,
        "client_request_id": rec.client_request_id,
        "kind": rec.kind,
        "model": rec.model or None,
        "status": rec.status,
        "code": rec.code,
        "worker": rec.worker or None,
        "prefill_worker": rec.prefill_worker,
        "stream": rec.stream,
        "ttft_ms": _ms(rec.ttft_s),
        "tpot_ms": _ms(rec.tpot_s),
        "e2e_ms": _ms(rec.e2e_s),
        "prompt_tokens": rec.prompt_tokens,
        "output_tokens": rec.output_tokens,
        "cached_tokens": rec.cached_tokens,
        "predicted_cached_tokens": rec.predicted_cached,
        "finish_reason": rec.finish_reason,
        "slo": outcome,
        "retries": rec.retries or None,
        "route_reason": rec.route_reason or None,
    }


@dataclass
class Tally:
    """One worker's requests since the last summary."""

    requests: int = 0
    failed: int = 0
    prompt: int = 0
    cached: int = 0
    ttft_s: float = 0.0
    ttfts: int = 0


class Accounting:
    def __init__(self, metrics: GatewayMetrics, fleet, policy: str, access: bool = True, summary_s: float = 0.0):
        self.metrics, self.fleet, self.policy = metrics, fleet, policy
        self.access, self.summary_s = access, summary_s
        self.tallies: dict[str, Tally] = {}
        self.outcomes: dict[str, int] = {}
        self._task: asyncio.Task | None = None
        if access:
            access_log.setLevel(logging.INFO)
        if summary_s > 0:
            fleet_log.setLevel(logging.INFO)

    def finish(self, rec: RequestRecord) -> None:
        """A request has ended (its status set): count it, log it, close its trace."""
        if rec.finished_at is None:
            rec.finished_at = time.monotonic()
        counted = rec.kind in GENERATION or rec.generation
        outcome = slo_outcome(rec) if counted else None
        if counted:
            self.metrics.observe(rec)
        self._close_trace(rec, outcome)
        if self.access and access_log.isEnabledFor(logging.INFO):
            fields = {k: v for k, v in access_fields(rec, outcome).items() if v is not None}
            # as access_log.info would, less its walk up the stack for a caller no format shows
            record = access_log.makeRecord(
                access_log.name, logging.INFO, "", 0, "request", (), None, extra={"fields": fields}
            )
            access_log.handle(record)
        if self.summary_s > 0 and counted:
            self._tally(rec, outcome)

    def _close_trace(self, rec: RequestRecord, outcome: str | None) -> None:
        t = rec.trace
        t.set(
            cached_tokens=rec.cached_tokens,
            ttft_ms=_ms(rec.ttft_s),
            slo=outcome,
            predicted_cached_tokens=rec.predicted_cached,
        )
        t.set_raw(
            {
                "gen_ai.operation.name": OPERATION.get("chat" if rec.generation else rec.kind),
                "gen_ai.request.model": rec.model or None,
                "gen_ai.response.model": rec.model or None,
                "gen_ai.request.id": rec.request_id,
                "gen_ai.usage.input_tokens": rec.prompt_tokens,
                "gen_ai.usage.output_tokens": rec.output_tokens,
                "gen_ai.response.finish_reasons": [rec.finish_reason] if rec.finish_reason else None,
            }
        )
        t.end(rec.status)

    def _tally(self, rec: RequestRecord, outcome: str | None) -> None:
        if outcome is not None:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if not rec.worker:
            return
        t = self.tallies.setdefault(rec.worker, Tally())
        t.requests += 1
        t.failed += outcome == FAILED
        if rec.cached_tokens is not None:
            t.prompt += rec.prompt_tokens or 0
            t.cached += rec.cached_tokens
        if rec.ttft_s is not None:
            t.ttft_s += rec.ttft_s
            t.ttfts += 1

    def summary(self) -> list[dict]:
        """The fleet's line and one per worker, for the requests since the last summary."""
        tallies, self.tallies = self.tallies, {}
        outcomes, self.outcomes = self.outcomes, {}
        workers = list(self.fleet.workers.values())
        judged = sum(outcomes.values())
        lines = [
            {
                "policy": self.policy,
                "workers": len(workers),
                "healthy": sum(w.available for w in workers),
                "requests": sum(t.requests for t in tallies.values()),
                "slo_judged": judged,
                "slo_attainment": round(outcomes.get(MET, 0) / judged, 4) if judged else None,
                **{f"slo_{k}": v for k, v in sorted(outcomes.items())},
            }
        ]
        for w in workers:
            t = tallies.get(w.worker_id or "", Tally())
            lines.append(
                {
                    "worker": w.worker_id or w.url,
                    "model": w.model,
                    "healthy": w.available,
                    "out": w.out,
                    "in_flight": w.in_flight,
                    "requests": t.requests,
                    "failed": t.failed,
                    "hit_ratio": round(t.cached / t.prompt, 4) if t.prompt else None,
                    "ttft_ms": _ms(t.ttft_s / t.ttfts) if t.ttfts else None,
                }
            )
        return lines

    async def _summarize(self) -> None:
        while True:
            await asyncio.sleep(self.summary_s)
            fleet, *workers = self.summary()
            fleet_log.info("fleet", extra={"fields": {k: v for k, v in fleet.items() if v is not None}})
            for line in workers:
                fleet_log.info("worker", extra={"fields": {k: v for k, v in line.items() if v is not None}})

    def start(self) -> None:
        if self.summary_s > 0:
            self._task = asyncio.ensure_future(self._summarize())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
