"""What the engine hands back per request and step: output deltas, and how they are delivered."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine hands its requests in; outputs do not need the class to run
    from workers.request import Request


@dataclass
class RequestTimes:
    """When (time.monotonic()) the engine took a request in, first scheduled it, resolved its
    first token and ended it; `chunks` are its prefill chunks (launched, resolved, tokens) when
    it was traced. Read by the worker's latency metrics and spans."""

    queued: float
    scheduled: float | None
    first_token: float | None
    finished: float
    chunks: list | None = None

    @classmethod
    def of(cls, req) -> "RequestTimes":
        return cls(req.arrival, req.scheduled_at, req.first_token_at, time.monotonic(), req.chunks)


@dataclass
class TokenLogprobs:
    """One sampled token's log-probability and the `top` (token id, log-probability) pairs, best
    first, under the model's raw distribution (log-softmax of its logits, before temperature,
    top-k or top-p: vLLM's default `raw_logprobs`)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """A delta for one request after a step; `finish_reason` is set on the last one. A failed
    request ends with finish_reason "error" and `error` saying why (ENGINE_ERROR/ENGINE_STOPPED)."""

    request_id: str
    token_ids: list[int]
    text: str
    num_prompt: int
    num_cached: int
    num_output: int
    finish_reason: str | None = None
    error: str | None = None
    times: RequestTimes | None = None  # on the last output of a request the engine took in
    logprobs: list[TokenLogprobs] | None = None  # one per token in `token_ids`, when asked for

    def add(self, later: "RequestOutput") -> None:
        """Merge the same request's next delta into this one (vLLM's `RequestOutput.add`):
        tokens, their text and logprobs appended; counts, end and times are the later's, as
        they are the request's so far. A reader that lags reads the merge as it would both."""
        self.token_ids.extend(later.token_ids)
        self.text += later.text
        if later.logprobs:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        self.num_prompt, self.num_cached, self.num_output = later.num_prompt, later.num_cached, later.num_output
        self.finish_reason, self.error, self.times = later.finish_reason, later.error, later.times


def ended(req: "Request", finish_reason: str | None, error: str | None = None, timed: bool = False) -> RequestOutput:
    """The last output of a request the engine took in that ends without a token (aborted,
    evicted, failed), with its counts so far; `timed`: with its times (`RequestTimes.of`)."""
    times = RequestTimes.of(req) if timed else None
    cached = max(req.num_cached, 0)
    return RequestOutput(req.request_id, [], "", req.num_prompt, cached, req.num_output, finish_reason, error, times)


def unstarted_failure(rid: str, prompt_ids: list[int], why: str) -> RequestOutput:
    """The one output of a request that failed before the engine took it in."""
    return RequestOutput(rid, [], "", len(prompt_ids), 0, 0, "error", why)


def call_sinks(batch: list[tuple[Callable, RequestOutput]]) -> None:
    for sink, out in batch:
        sink(out)
