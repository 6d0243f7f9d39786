"""The requests the engine owes an answer, and the answers it owes them (vLLM v1's `OutputProcessor`).

Each request the engine took in has a `RequestState`: its scheduler `Request`, its
detokenizer and the sink its outputs go to. Outputs wait in the outbox and leave as one batch
a step (the engine's `deliver`): one wakeup of the server's loop a step, not one a stream.
All of it runs on the engine thread.
"""

from collections.abc import Callable
from dataclasses import dataclass

from workers.detokenizer import Detokenizer
from workers.outputs import RequestOutput, RequestTimes, TokenLogprobs
from workers.request import Request
from workers.scheduler import Sampled
from workers.step_stats import StepStats

Sink = Callable[[RequestOutput], None]


@dataclass
class RequestState:
    """A request the engine owes an answer: its scheduler record, its detokenizer (None: token
    ids only, no text) and the sink its outputs go to."""

    req: Request
    detokenizer: Detokenizer | None
    sink: Sink


class OutputProcessor:
    """The live requests by id and the outbox of (sink, output) pairs for this step's batch;
    counts the tokens it hands out in `stats`."""

    def __init__(self, stats: StepStats):
        self.stats = stats
        self.request_states: dict[str, RequestState] = {}
        self.outbox: list[tuple[Sink, RequestOutput]] = []

    def add_request(self, req: Request, detokenizer: Detokenizer | None, sink: Sink) -> None:
        self.request_states[req.request_id] = RequestState(req, detokenizer, sink)

    def pop(self, request_id: str) -> RequestState | None:
        """Stop owing the request anything more; its state, if it was live."""
        return self.request_states.pop(request_id, None)

    def send(self, sink: Sink, out: RequestOutput) -> None:
        """Queue `out` for `sink` in the next batch."""
        self.outbox.append((sink, out))

    def take(self) -> list[tuple[Sink, RequestOutput]]:
        """The queued batch, oldest first; the outbox starts empty again."""
        batch, self.outbox = self.outbox, []
        return batch

    def hit_stop_string(self, req: Request, tok: int, stop_token: bool) -> bool:
        """Add `tok` to the request's text (the text of a `stop_token`, one that ends the request,
        only where the request keeps its stop) and say whether the text now ends in one of its
        stop strings (the scheduler's `stop_string`: a stop is decided on the text, which only
        the detokenizer has)."""
        detok = self.request_states[req.request_id].detokenizer
        return detok.add(tok, stop_token) if detok else False

    def make_output(self, s: Sampled, logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """The delta for a resolved token (its text flushed whole when the request ended), with
        its logprobs when the executor computed them."""
        req = s.req
        if s.first:
            self.stats.prompt_tokens += req.num_prompt
            self.stats.cached_tokens += max(req.num_cached, 0)
        self.stats.generated_tokens += 1
        if s.finish_reason is not None:
            self.stats.finished += 1
        detok = self.request_states[req.request_id].detokenizer
        text = detok.flush(s.finish_reason is not None) if detok else ""
        return RequestOutput(
            req.request_id,
            [s.token],
            text,
            req.num_prompt,
            max(req.num_cached, 0),
            req.num_output,
            s.finish_reason,
            logprobs=None if logprobs is None else [logprobs],
        )

    def process_outputs(self, outputs: list[RequestOutput]) -> None:
        """Queue each output of a live request for its sink; a last output carries its
        request's times and ends what is owed to it."""
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state:
                self.send(state.sink, out)
            if out.finish_reason is not None:
                self.request_states.pop(out.request_id, None)
                if state:
                    out.times = RequestTimes.of(state.req)
