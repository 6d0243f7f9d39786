"""What the gateway reads from a worker's answer in passing, for its accounting: when a
stream's first and last token events came, the finish reason, the usage (output and cached
tokens); from a whole answer, the same and the worker's TTFT header. Read as bytes with a few
patterns, never parsed as JSON, which would cost every streamed event a parse.
"""

import re
import time

from gateway.record import RequestRecord
from workers.protocol import TTFT_HEADER

_CACHED = re.compile(rb'"cached_tokens":\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')
_FINISH = re.compile(rb'"finish_reason":\s*"(\w+)"')
_TOKEN_EVENT = re.compile(rb'"choices":\s*\[\s*\{')  # an event carrying a choice (the usage event has none)


class StreamTap:
    """What the gateway learns from a stream of whole events in passing: when its first and
    last token events came, its finish reason, and its usage (output and cached tokens). A
    usage event the gateway asked for on the client's behalf (`hide_usage`) is read and
    dropped: the client did not ask for it."""

    def __init__(self, kind: str, started: float, hide_usage: bool = False, choices: int = 1):
        self.started = started
        # a chat stream opens with a role-only event per choice
        self.events_before_token = choices + 1 if kind == "chat" else 1
        self.hide_usage = hide_usage
        self.events = 0
        self.ttft: float | None = None
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.cached: int | None = None
        self.output_tokens: int | None = None
        self.finish_reason: str | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Read a run of whole events; returns what is passed on to the client."""
        now = None
        if self.ttft is None:
            self.events += chunk.count(b"data: ")
            if self.events >= self.events_before_token:
                now = self.first_at = time.monotonic()
                self.ttft = now - self.started
        if _TOKEN_EVENT.search(chunk):
            self.last_at = now if now is not None else time.monotonic()
            if b'"finish_reason":"' in chunk or b'"finish_reason": "' in chunk:
                self.finish_reason = _FINISH.findall(chunk)[-1].decode()
        if b'"usage"' in chunk:
            self.cached = cached_tokens(chunk)
            m = _COMPLETION.search(chunk)
            self.output_tokens = int(m.group(1)) if m else self.output_tokens
            if self.hide_usage:
                *events, rest = chunk.split(b"\n\n")
                chunk = b"".join(e + b"\n\n" for e in events if not _usage_event(e)) + rest
        return chunk


def _usage_event(event: bytes) -> bool:
    """Whether an SSE event carries usage and no choice (the final usage-only event)."""
    return event.startswith(b"data: {") and b'"usage"' in event and not _TOKEN_EVENT.search(event)


def ask_usage(body: dict) -> bool:
    """Make a (validated) streaming request ask for its usage event, which the gateway reads
    for its accounting and then drops (`StreamTap.hide_usage`); True when the client had not
    asked for it itself."""
    opts = body.get("stream_options")
    if body.get("stream") is not True or (isinstance(opts, dict) and opts.get("include_usage") is True):
        return False
    body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return True


def whole_answer(rec: RequestRecord, body: bytes, headers, sent: float) -> None:
    """What a whole (non-streaming) 200 answer tells: usage, finish reason and, from the
    worker's TTFT header, when its first token came (`sent`: when the gateway sent it)."""
    rec.cached_tokens = cached_tokens(body)
    m = _COMPLETION.search(body)
    rec.output_tokens = int(m.group(1)) if m else None
    reasons = _FINISH.findall(body)
    rec.finish_reason = reasons[-1].decode() if reasons else None
    rec.last_token_at = time.monotonic()
    try:
        ttft_ms = float(headers.get(TTFT_HEADER, "nan"))
    except ValueError:
        ttft_ms = float("nan")
    if 0 <= ttft_ms < float("inf"):
        rec.first_token_at = min(sent + ttft_ms / 1000.0, rec.last_token_at)


def cached_tokens(body: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` from a response body or usage event."""
    m = _CACHED.search(body)
    return int(m.group(1)) if m else None
