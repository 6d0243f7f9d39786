"""A chat completion's stream as the Responses API's events, for a model of kvgate's workers, in
the order and shapes vLLM 0.32 and OpenAI send them: response.created, response.in_progress,
response.output_item.added, response.content_part.added, a response.output_text.delta per chat
chunk with text, response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed (or response.incomplete when the output
ran out of max_output_tokens, or response.failed when the worker failed mid-stream), each
numbered by `sequence_number` from 0 and written `event: NAME\\ndata: JSON\\n\\n`.

Pure: fed the chat stream's bytes, it returns the bytes of the events they make.
"""

import json
from collections.abc import Awaitable, Callable

from gateway.response_object import (
    FAILED,
    IN_PROGRESS,
    INCOMPLETE,
    Usage,
    new_message_id,
    output_message,
    output_text,
    response_json,
    status_of,
)
from gateway.response_request import CreateRequest

CUT_SHORT = "the worker's stream ended before its last event"
MALFORMED = "the worker's stream was not well formed"
TERMINAL = {"completed": "response.completed", INCOMPLETE: "response.incomplete", FAILED: "response.failed"}


class ResponseEvents:
    """The events of response `response_id` (created at `created_at`) of `req`, from its chat
    stream's events fed in order (`feed`, then `finish` with the stream's last bytes).
    `on_end` gets the final Response object once, just before its terminal event is made, and
    returns what that event must wait for before it reaches the client (`take_hold`), or None."""

    def __init__(
        self,
        req: CreateRequest,
        response_id: str,
        created_at: int,
        on_end: Callable[[dict], Awaitable[None] | None],
    ):
        self.req, self.response_id, self.created_at, self.on_end = req, response_id, created_at, on_end
        self.hold: Awaitable[None] | None = None
        self.message_id = new_message_id()
        self.sequence = 0
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.started = self.ended = False
        self.partial = b""

    def feed(self, chunk: bytes) -> bytes:
        """The events that the whole chat events in `chunk` (with what an earlier chunk left
        unfinished) make."""
        data = self.partial + chunk
        cut = data.rfind(b"\n\n") + 2  # 1 where no event ends: all of it is held back
        data, self.partial = (data[:cut], data[cut:]) if cut > 1 else (b"", data)
        out = [] if self.started else self.opening()
        self.started = True
        for event in data.split(b"\n\n"):
            if not self.ended and event.strip():
                out += self.chat_event(event)
        return b"".join(out)

    def finish(self, tail: bytes) -> bytes:
        """The events of the stream's last bytes, then its end: a stream that did not end as a
        chat stream ends ([DONE]) is a failed response."""
        out = self.feed(tail + (b"\n\n" if self.partial or tail.strip() else b""))
        if not self.ended:
            out += b"".join(self.failed(CUT_SHORT))
        return out

    def chat_event(self, event: bytes) -> list[bytes]:
        data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if not data:
            return []
        if data == b"[DONE]":
            return self.done()
        try:
            d = json.loads(data)
        except ValueError:
            return self.failed(MALFORMED)
        if not isinstance(d, dict):
            return self.failed(MALFORMED)
        if "error" in d:
            error = d["error"]
            message = error.get("message") if isinstance(error, dict) else None
            return self.failed(message if isinstance(message, str) else "the worker failed")
        out = []
        choices = d.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(text, str) and text:
                self.texts.append(text)
                out.append(self.event("response.output_text.delta", self.at() | {"delta": text, "logprobs": []}))
            if isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
        if d.get("usage") is not None:
            self.usage = Usage.from_chat(d["usage"])
        return out

    def opening(self) -> list[bytes]:
        head = {"response": self.response(IN_PROGRESS, [])}
        item = output_message(self.message_id, "", IN_PROGRESS) | {"content": []}
        return [
            self.event("response.created", head),
            self.event("response.in_progress", head),
            self.event("response.output_item.added", {"output_index": 0, "item": item}),
            self.event("response.content_part.added", self.at() | {"part": output_text("")}),
        ]

    def done(self) -> list[bytes]:
        """The stream ended whole: the text's, the part's and the item's ends, then the
        response's, by its finish reason."""
        status = status_of(self.finish_reason)
        if status == FAILED:
            return self.failed(f"the generation ended: {self.finish_reason or 'no finish reason'}")
        text = "".join(self.texts)
        item = output_message(self.message_id, text, status)
        ends = [
            self.event("response.output_text.done", self.at() | {"text": text, "logprobs": []}),
            self.event("response.content_part.done", self.at() | {"part": output_text(text)}),
            self.event("response.output_item.done", {"output_index": 0, "item": item}),
        ]
        return ends + [self.end(status, [item])]

    def failed(self, message: str) -> list[bytes]:
        """The worker failed mid-stream: response.failed, with what it had output."""
        output = [output_message(self.message_id, "".join(self.texts), INCOMPLETE)] if self.texts else []
        return [self.end(FAILED, output, message)]

    def end(self, status: str, output: list[dict], error: str | None = None) -> bytes:
        self.ended = True
        final = self.response(status, output, error)
        self.hold = self.on_end(final)
        return self.event(TERMINAL[status], {"response": final})

    def take_hold(self) -> Awaitable[None] | None:
        """What the terminal event made since the last call waits for (`on_end`'s), once."""
        hold, self.hold = self.hold, None
        return hold

    def response(self, status: str, output: list[dict], error: str | None = None) -> dict:
        usage = self.usage if status != IN_PROGRESS else None
        return response_json(self.req, self.response_id, self.created_at, status, output, usage, error)

    def at(self) -> dict:
        """Where the text is: the one message item's one content part."""
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def event(self, name: str, fields: dict) -> bytes:
        body = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + name.encode() + b"\ndata: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
