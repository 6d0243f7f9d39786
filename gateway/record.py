"""What the gateway learns about one request, from its arrival to its last byte, and how it did
against its SLOs. Filled in as the request goes (routing, the worker's answer, the stream's
events) and read once at its end by the metrics, the access log and the trace."""

from dataclasses import dataclass, field

from gateway.tracing import NO_TRACE, RequestTrace

MET, TTFT_MISS, TPOT_MISS, REJECTED, FAILED = "met", "ttft_miss", "tpot_miss", "rejected", "failed"
SLO_OUTCOMES = (MET, TTFT_MISS, TPOT_MISS, REJECTED, FAILED)
WHOLE, PREFILL, DECODE = "whole", "prefill", "decode"  # which leg of a request a worker served
NOT_REJECTIONS = ("rate_limit_exceeded",)  # a client over its own quota is not the fleet's refusal


@dataclass(eq=False)
class RequestRecord:
    """Times are time.monotonic(). `first_token_at` is when the first token reached the gateway
    (a stream's first token event; for a whole answer, when the worker says it made it);
    `predicted_cached` is what the answering worker was expected to hold of the prompt."""

    request_id: str
    kind: str
    arrived: float
    trace: RequestTrace = field(default=NO_TRACE)
    client_request_id: str | None = None
    model: str = ""
    worker: str = ""
    prefill_worker: str | None = None
    status: int = 0
    code: str | None = None
    stream: bool = False
    hide_usage: bool = False  # usage was asked of the worker by the gateway, not the client
    ids_sent: bool = False  # the prompts' ids went to the worker (kv_prompt_ids), with the fleet's token
    generation: bool = False  # a Responses API create served as a chat (gateway/local_responses.py): counted as one
    prompt_tokens: int | None = None
    max_tokens: int | None = None  # each choice's budget, as the gateway parsed it (None: not parsed here)
    predicted_cached: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    retries: int = 0
    route_reason: str = ""  # the policy's reason for the worker it chose
    candidates: str = ""  # each candidate's cached prefix and load when it chose (routing.candidates_summary)

    @property
    def leg(self) -> str:
        return DECODE if self.prefill_worker else WHOLE

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrived

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrived

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (needs two tokens and their times)."""
        n, first, last = self.output_tokens, self.first_token_at, self.last_token_at
        if not n or n < 2 or first is None or last is None:
            return None
        return max(0.0, last - first) / (n - 1)


def slo_outcome(rec: RequestRecord) -> str | None:
    """`met`, `ttft_miss` or `tpot_miss` for an answer (judged against the request's SLOs; one
    without SLOs is met by being answered), `rejected` for load shed (429/503), `failed` for a
    server error or a stream broken off; None for what the client caused (4xx, a disconnect).
    A whole answer without the worker's first-token time is judged by its end-to-end time,
    which bounds its TTFT."""
    if rec.status in (429, 503):
        return None if rec.code in NOT_REJECTIONS else REJECTED
    if rec.status >= 500 or (rec.status == 200 and rec.finish_reason == "error"):
        return FAILED
    if rec.status != 200:
        return None
    ttft = rec.ttft_s if rec.ttft_s is not None else rec.e2e_s
    if rec.slo_ttft_ms is not None and ttft is not None and ttft * 1000.0 > rec.slo_ttft_ms:
        return TTFT_MISS
    tpot = rec.tpot_s
    if rec.slo_tpot_ms is not None and tpot is not None and tpot * 1000.0 > rec.slo_tpot_ms:
        return TPOT_MISS
    return MET
