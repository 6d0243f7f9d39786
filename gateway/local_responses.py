"""The Responses API for a model of kvgate's own workers, served by the gateway on top of its
chat path (as SGLang's gateway does): the gateway owns the responses and their history, the
workers only ever see chat completions.

A create is checked (gateway/response_request.py), turned into a chat completion whose prompt
is the whole conversation (gateway/response_chat.py), and sent through the gateway's chat
pipeline as any chat is: tokenized, admitted, charged, routed by the policy on its KV blocks,
retried, counted and traced. So a follow-up (`previous_response_id`), whose prompt starts with
its previous turn's, is routed to where that turn is cached. The chat's answer is turned back
into the Responses API's: a whole one read and converted (gateway/response_object.py), a stream
converted event by event as it is relayed (gateway/response_stream.py). A response created
with `store` (the default) is kept by the gateway (gateway/response_store.py, shared through
Redis), scoped to the tenant whose key made it, for its retrieve and its follow-ups.
"""

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.intake import ApiError
from gateway.record import RequestRecord
from gateway.relay import PassThrough
from gateway.response_chat import ChatAnswer, answered, as_responses_error, chat_body
from gateway.response_events import ResponseEvents
from gateway.response_object import (
    COMPLETED,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    INCOMPLETE,
    new_message_id,
    new_response_id,
    output_message,
    response_json,
    status_of,
)
from gateway.response_request import CreateRequest, parse_create
from gateway.response_store import ResponseStore
from gateway.response_stream import ResponseStream
from gateway.stored_response import StoredResponse
from workers.generation_defaults import NEUTRAL, GenerationDefaults

Chat = Callable[[Request, bytes, RequestRecord], Awaitable[Response]]
KEPT_HEADERS = ("x-kvgate-",)  # the chat answer's headers a Responses answer keeps: routing's


class LocalResponses:
    """Creates served by `chat` (the gateway's chat pipeline: body -> answer, raising ApiError),
    stored in `store`; `defaults(model)`, the sampling defaults its workers serve a model with
    (what an answer shows for a field its create left out)."""

    def __init__(
        self, chat: Chat, store: ResponseStore, defaults: Callable[[str], GenerationDefaults] = lambda _: NEUTRAL
    ):
        self.chat, self.store, self.defaults = chat, store, defaults

    async def create(
        self,
        request: Request,
        body: dict,
        model: str,
        tenant: str,
        rec: RequestRecord,
        previous: StoredResponse | None = None,
    ) -> Response:
        """A create for `model` by `tenant`, following `previous` (the stored response its
        `previous_response_id` names, looked up by the caller: gateway/responses.py); raises
        ApiError. It is a generation request from the start: its refusals count as the chat
        path's do."""
        rec.generation = True
        req = parse_create(body, model)
        found = previous.response_id if previous is not None else None
        assert found == req.previous_response_id, "a follow-up's previous response is looked up by the caller"
        history = previous.messages() if previous is not None else ()
        conversation = history + req.input
        response_id, created_at = new_response_id(), int(time.time())

        def keep(response: dict) -> Awaitable[None] | None:
            """Store the response (unless `store: false`); returns what its answer's end waits for."""
            if not req.store:
                return None
            return self.store.put(StoredResponse.of(response_id, tenant, response, conversation + answered(response)))

        try:
            answer = await self.chat(request, json.dumps(chat_body(req, conversation)).encode(), rec)
        except ApiError as e:
            raise as_responses_error(e)
        req = self.sampled(req, rec)
        if isinstance(answer, PassThrough):
            return ResponseStream(answer, ResponseEvents(req, response_id, created_at, keep))
        if answer.status_code != 200:
            return answer  # the chat path's own answer: an OpenAI error, or a client gone (499)
        try:
            chat = ChatAnswer.from_whole(bytes(answer.body))
        except ValueError as e:
            raise ApiError(502, f"the worker's answer is not a chat completion: {e}", "server_error", "worker_failed")
        status = status_of(chat.finish_reason)
        item_status = COMPLETED if status == COMPLETED else INCOMPLETE
        output = [output_message(new_message_id(), chat.text, item_status)]
        error = None if status != "failed" else f"the generation ended: {chat.finish_reason or 'no finish reason'}"
        response = response_json(req, response_id, created_at, status, output, chat.usage, error)
        stored = keep(response)
        if stored is not None:
            await stored  # a follow-up sent to another replica the instant this answer ends finds it
        headers = {k: v for k, v in answer.headers.items() if k.startswith(KEPT_HEADERS)}
        return JSONResponse(response, headers=headers)

    def sampled(self, req: CreateRequest, rec: RequestRecord) -> CreateRequest:
        """`req` as its answer shows it, vLLM's way: the temperature, top_p and budget it was
        generated with, the model's defaults (and the budget the gateway parsed) where it set none."""
        d = self.defaults(req.model)
        return replace(
            req,
            temperature=d.value("temperature", DEFAULT_TEMPERATURE) if req.temperature is None else req.temperature,
            top_p=d.value("top_p", DEFAULT_TOP_P) if req.top_p is None else req.top_p,
            max_output_tokens=rec.max_tokens if req.max_output_tokens is None else req.max_output_tokens,
        )

    def retrieve(self, record: StoredResponse, stream: bool) -> Response:
        """A stored response as it was answered; its events are not kept, so `stream` is a 400."""
        if stream:
            raise ApiError(
                400,
                f"response '{record.response_id}' has no events to stream again (the gateway keeps a response of "
                "kvgate's workers, not its events): retrieve it without stream=true",
                param="stream",
            )
        return Response(record.response, media_type="application/json")

    async def delete(self, record: StoredResponse) -> Response:
        """Delete a stored response (OpenAI's answer: its id, `response.deleted`, `deleted: true`);
        raises LookupFailed when Redis does not answer."""
        await self.store.delete(record)
        return JSONResponse({"id": record.response_id, "object": "response.deleted", "deleted": True})

    def cancel(self, record: StoredResponse) -> Response:
        """A response of kvgate's workers is never a background one, so it cannot be cancelled:
        vLLM's and OpenAI's 400 for a synchronous response."""
        raise ApiError(400, "Cannot cancel a synchronous response.", param="response_id")
