"""A committed chat stream relayed to a Responses API client as the Responses API's events
(gateway/response_events.py), for a model of kvgate's workers.

The chat path's relay (gateway/relay.py `PassThrough`) is used as it is: it writes the chat
stream's whole events to the request's `RawBody` as they arrive, and its last bytes (the held
back `[DONE]`, or the error event of a worker that failed mid-stream) through `send`. Here it
is handed a body and a `send` that turn what it writes into the Responses events before they
reach the client, so the chat relay stays as fast as it was, and this stream gets the same
bounds, failure handling, accounting and disconnect watch. The terminal event (response.completed,
incomplete or failed) reaches the client only once the response is stored (with Redis, once
Redis has it: gateway/shared_records.py), in a write's chunk or the final send alike.
"""

from gateway.raw_send import RAW_SEND, RawBody
from gateway.relay import PassThrough
from gateway.response_events import ResponseEvents
from gateway.response_tap import TappedBody


class EventsBody:
    """The client's `RawBody` behind the conversion of what the chat relay writes. The
    terminal event, when a write makes it, is held until the response is stored
    (`ResponseEvents.take_hold`, as response_tap.TappedBody holds an id)."""

    __slots__ = ("body", "events")

    def __init__(self, body: RawBody, events: ResponseEvents):
        self.body, self.events = TappedBody(body, [lambda chunk: events.take_hold()]), events

    def write(self, chunk: bytes) -> bool:
        return self.body.write(self.events.feed(chunk))

    async def drain(self) -> None:
        await self.body.drain()

    def abort(self) -> None:
        self.body.abort()


class ResponseStream(PassThrough):
    """The chat stream `chat` (a `PassThrough`) relayed as `events` make it. Its response head
    (status, headers: the gateway adds its own to this response's) and its `on_close` callbacks
    are the chat stream's."""

    def __init__(self, chat: PassThrough, events: ResponseEvents):
        self.status_code, self.background = chat.status_code, None
        self.raw_headers = chat.raw_headers  # one list: the headers the gateway adds here, the chat sends
        self.on_close = chat.on_close
        self.chat, self.events = chat, events

    async def __call__(self, scope, receive, send) -> None:
        extensions = scope["extensions"]
        body = EventsBody(extensions[RAW_SEND]["body"], self.events)
        scope = {**scope, "extensions": {**extensions, RAW_SEND: {"body": body}}}

        async def converted(message: dict) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                message = {**message, "body": self.events.finish(message.get("body", b""))}
                stored = self.events.take_hold()
                if stored is not None:
                    await stored
            await send(message)

        await self.chat(scope, receive, converted)
