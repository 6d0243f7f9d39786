"""One admitted request in the worker's HTTP server: its engine requests (one per choice) and
what its choices have produced, shaped the OpenAI way."""

from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from workers.metrics import RequestClock
from workers.output_collector import RequestOutputCollector
from workers.outputs import RequestOutput
from workers.protocol import ParsedRequest
from workers.responses import chat_logprobs, completion_logprobs, usage


@dataclass
class Job:
    """One admitted request: `key` keys it in the engine, `shown` is the id its answer carries.
    Each of its choices is an engine request of its own (`engine_key`), timed by its own clock
    for the metrics; `outputs` holds its choices' outputs until read (merged per choice while
    the reader lags). `span` traces choice 0 (None while tracing is off). `running` holds the
    choices handed to the engine whose last output has not arrived. `cancelled` is set once no
    one reads the answer any more: a choice not started by then never starts."""

    key: str
    shown: str
    parsed: ParsedRequest
    clocks: list[RequestClock]
    outputs: RequestOutputCollector = field(default_factory=RequestOutputCollector)
    span: Span | None = None
    running: set[int] = field(default_factory=set)
    cancelled: bool = False

    def engine_key(self, choice: int) -> str:
        return self.key if self.parsed.num_choices == 1 else f"{self.key}-{choice}"


@dataclass
class Choices:
    """What a request's choices have produced so far, and how each must be reported. A request
    fails whole: its first failed choice (`failure`) ends it, as every choice ending does.
    Whether it has ended is asked on every output: `ended_choices` is counted as they end, so
    the asking costs the same for 1 choice or MAX_CHOICES."""

    parsed: ParsedRequest
    decode: Callable[[int], str]
    last: dict[int, RequestOutput] = field(default_factory=dict)
    offsets: dict[int, int] = field(default_factory=dict)  # completions logprobs' text offset per choice
    failure: RequestOutput | None = None
    ended_choices: int = 0

    @property
    def done(self) -> bool:
        return self.ended_choices == self.parsed.num_choices

    @property
    def ended(self) -> bool:
        """Nothing more to read: every choice ended, or one failed."""
        return self.failure is not None or self.done

    def has_ended(self, i: int) -> bool:
        out = self.last.get(i)
        return out is not None and out.finish_reason is not None

    def add(self, i: int, out: RequestOutput) -> None:
        """Choice `i`'s next output; its last one (finish_reason set) comes once."""
        self.last[i] = out
        if out.finish_reason is not None:
            self.ended_choices += 1
        if out.error is not None and self.failure is None:
            self.failure = out

    def echo(self, i: int) -> str:
        texts = self.parsed.echo_texts
        return texts[i // self.parsed.n] if texts else ""

    def logprobs(self, i: int, entries: list | None) -> dict | None:
        """The choice's `logprobs` object for these tokens (None when not asked for)."""
        if self.parsed.params.logprobs is None or entries is None:
            return None
        if self.parsed.kind == "chat":
            return chat_logprobs(entries, self.decode)
        offset = self.offsets.get(i, len(self.echo(i)))
        body = completion_logprobs(entries, self.decode, offset)
        self.offsets[i] = offset + sum(map(len, body["tokens"]))
        return body

    def usage(self) -> dict:
        """Every prompt's tokens once (counted and cached by its first completion), every
        completion's tokens."""
        firsts = [self.last[i] for i in range(0, self.parsed.num_choices, self.parsed.n)]
        return usage(
            sum(o.num_prompt for o in firsts),
            sum(o.num_output for o in self.last.values()),
            sum(o.num_cached for o in firsts),
        )
