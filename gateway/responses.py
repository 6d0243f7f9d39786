"""The Responses API through the gateway: `POST /v1/responses` (create), `GET
/v1/responses/{response_id}` (retrieve; `?stream=true` replays the events of a response created
with both `background` and `stream`),
`POST /v1/responses/{response_id}/cancel` and `DELETE /v1/responses/{response_id}` (the gateway's
own responses only: vLLM deletes none). A model with a vLLM worker (registered, healthy or
not) is served by its vLLM workers, as below; a model of kvgate's own workers alone by the
gateway itself, over its chat path (gateway/local_responses.py), the gateway keeping the
responses. A follow-up, retrieve or cancel goes where its id is known, whatever the model's
workers now: among the gateway's own responses first, then in the ledger of vLLM's. So a model
whose vLLM workers are all down answers 503s, as a vLLM model does, and a response the gateway
made for it before it had a vLLM worker is still continued on the gateway's path.

A vLLM server keeps a stored response in its own memory (with VLLM_ENABLE_RESPONSES_API_STORE;
`store` is a create's default), and only that server can continue it (`previous_response_id`),
return it or cancel it: another server answers 404, as it has never seen the id. So:

- a create without `previous_response_id` goes to the least loaded vLLM worker of its model
  with room in its queue, retried elsewhere when one fails before answering, as an embedding
  does (gateway/forward.py: the same body cap, admission, API keys, per-key rates, breakers);
- the gateway learns each response's id from the answer as it relays it (gateway/response_tap.py)
  and records the worker, the key's tenant and whether the response's events can be streamed
  again (created with both `background` and `stream`: vLLM keeps no events of any other, and
  breaks off a `?stream=true` retrieve of one after its head, so that is the gateway's own 400)
  (gateway/response_ids.py: an LRU with a TTL; with `--redis` shared by the replicas,
  gateway/shared_response_ids.py); a `store: false` create is not recorded;
- a follow-up, a retrieve and a cancel go to the recorded worker only, one try, never
  elsewhere. An id the gateway does not know, or recorded for another tenant, is the same 404
  (`response_not_found`: nothing says it exists; Redis not answering, the same 503
  `response_lookup_failed` for both); a recorded worker that is unavailable now (down,
  out of service, suspect, its breaker open, or gone from the fleet) is a 503
  (`response_worker_unavailable`, with Retry-After): the response may come back with its worker,
  and no other server could answer for it.

A create is engine work (counted in flight, its breaker's to count); a retrieve or cancel is
not, and its broken answer is counted in the metrics only, never against the worker (the client
steers it). A stream opens with two events at once, then waits for its first token: until an
event past those its silence is bounded by the first-byte timeout, as a chat stream's first
token is, then by the idle timeout. A create's input (`instructions`, `input`'s texts, by the
model's tokenizer; other items at a quarter of the body's bytes) and its `max_output_tokens`
(without it, the rest of the model's context, which vLLM may generate) are charged to a key's
tokens-per-minute budget; a previous response's history, which only the worker sees, is not.
The body goes to vLLM unchanged but for the tenant's `cache_salt`; fields internal to the fleet
and `request_id` (the stored response's name, response_fields.py) are refused. These requests
count in the metrics as the forwarded ones do (gateway/forward.py): an access-log line (`kind`)
and a trace each, worker failures, retries and refusals, not the generation series.
"""

import json
import logging
import random
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import vllm_worker
from gateway.auth import api_key
from gateway.exchange import whole_body
from gateway.forward import NOT_POOLING, UNSERVED, Forwarder
from gateway.intake import ApiError, client_body, refused
from gateway.local_responses import LocalResponses
from gateway.pooling import input_tokens
from gateway.record import RequestRecord
from gateway.response_fields import create_fields, input_texts, retrieve_query
from gateway.response_ids import Owner, ResponseIds, valid_id
from gateway.response_request import previous_id
from gateway.response_tap import IdTap, Opening, TappedPassThrough
from gateway.shared_records import LookupFailed
from gateway.shared_response_ids import SharedResponseIds
from gateway.stored_response import StoredResponse
from gateway.worker import Worker
from policies.candidates import cheapest

log = logging.getLogger("kvgate.gateway")

CREATE, RETRIEVE, CANCEL = "responses", "responses_retrieve", "responses_cancel"
DELETE = "responses_delete"
RESPONSES_KINDS = frozenset({CREATE, RETRIEVE, CANCEL, DELETE})
TRACE_NAMES = {
    CREATE: "POST /v1/responses",
    RETRIEVE: "GET /v1/responses/{response_id}",
    CANCEL: "POST /v1/responses/{response_id}/cancel",
    DELETE: "DELETE /v1/responses/{response_id}",
}
NOT_FOUND, UNAVAILABLE, LOOKUP_FAILED = "response_not_found", "response_worker_unavailable", "response_lookup_failed"
T = TypeVar("T")


def new_id() -> str:
    """A Responses API request's gateway id (not the response's: vLLM names that)."""
    return "respreq-" + uuid.uuid4().hex[:24]


def routes(endpoint: Callable[[str], Callable[[Request], Awaitable[Response]]]) -> list[Route]:
    """The routes, each kind served by `endpoint(kind)`. A response's path takes GET (retrieve)
    and DELETE in one route, so starlette's 405 for another method names both (`Allow`); not
    HEAD, which starlette adds to a GET route: a HEAD's answer has no body, but a worker's body
    is relayed past uvicorn's send (gateway/raw_send.py)."""
    retrieve, delete = endpoint(RETRIEVE), endpoint(DELETE)

    async def one(request: Request) -> Response:
        return await (delete if request.method == "DELETE" else retrieve)(request)

    response = Route("/v1/responses/{response_id}", one, methods=["GET", "DELETE"])
    assert response.methods is not None
    response.methods.discard("HEAD")
    return [
        Route("/v1/responses", endpoint(CREATE), methods=["POST"]),
        response,
        Route("/v1/responses/{response_id}/cancel", endpoint(CANCEL), methods=["POST"]),
    ]


class Responses:
    """Serves the Responses API with the forwarder's fleet, client and limits (`forwarder`), the
    gateway's ledger of response ids (`ids`) and, with Redis, the replicas' (`shared`); and
    with `local` for the models of kvgate's workers."""

    def __init__(
        self,
        forwarder: Forwarder,
        ids: ResponseIds,
        shared: SharedResponseIds | None = None,
        local: LocalResponses | None = None,
    ):
        self.forwarder, self.ids, self.shared, self.local = forwarder, ids, shared, local

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()
        if self.local is not None:
            await self.local.store.close()

    async def serve(self, request: Request, kind: str, raw: bytes, rec: RequestRecord) -> Response:
        """One request of `kind`; raises ApiError."""
        if kind == CREATE:
            return await self.create(request, raw, rec)
        return await self.stored(request, kind, rec)

    async def create(self, request: Request, raw: bytes, rec: RequestRecord) -> Response:
        """A create: a follow-up where its previous response is known (the gateway's own
        responses, or the ledger of vLLM's); else by the kinds of worker the model has,
        registered, healthy or not (vLLM's path if it has a vLLM worker, else the gateway's):
        a model's vLLM workers all down are a 503, never the gateway's path answering for
        them. vLLM's: checked, charged, to the previous response's worker or the least loaded."""
        fwd = self.forwarder
        body = client_body(raw)
        model = rec.model = fwd.intake.resolve_model(body.get("model"), fwd.fleet.models())
        rec.trace.set(model=model)
        key = api_key(request.scope)
        tenant = key.tenant if key is not None else ""
        vllm = any(w.kind == vllm_worker.KIND and w.model == model for w in fwd.fleet.workers.values())
        rec.generation = self.local is not None and not vllm  # the gateway's path: counted as a chat
        previous = await self.previous(body, tenant)
        if self.local is not None and (isinstance(previous, StoredResponse) or (previous is None and not vllm)):
            return await self.lookup(self.local.create(request, body, model, tenant, rec, previous))
        rec.generation = False
        fields = create_fields(body)
        texts, estimated = input_texts(body)
        rec.stream = fields.stream
        if previous is None and not vllm:
            raise not_supported(model)
        holder = None
        if fields.previous_response_id is not None and isinstance(previous, Owner):
            holder = self.holder(fields.previous_response_id, previous)
        raw = await self.charged(request, body, raw, model, texts, estimated, fields.max_output_tokens)
        keep = tenant if fields.store else None
        whole = not (fields.stream or fields.background)  # answered only once generated
        replayable = fields.stream and fields.background

        def attempt(w: Worker, headers: dict) -> Awaitable[Response]:
            return self.attempt(request, w, "POST", "/v1/responses", raw, headers, rec, True, keep, whole, replayable)

        if holder is None:
            return await fwd.tries(rec, True, fwd.retry.max_retries, lambda ex: self.pick(model, ex), attempt)
        return await fwd.tries(rec, True, 0, lambda ex: self.with_room(holder), attempt)

    async def stored(self, request: Request, kind: str, rec: RequestRecord) -> Response:
        """A retrieve, cancel or delete: of the gateway's own response here, else at the worker
        that stored it. A retrieve's `stream=true` of a response that cannot be replayed
        (`Owner.replayable`) is the gateway's 400: vLLM would start its answer, then break it
        off. vLLM deletes no response (it has no such route): a delete of one of its responses is
        a 405 that changes nothing."""
        response_id = request.path_params["response_id"]
        key = api_key(request.scope)
        tenant = key.tenant if key is not None else ""
        query = retrieve_query(request) if kind == RETRIEVE else ""
        owner = await self.known(response_id, tenant, "response_id")
        if isinstance(owner, StoredResponse):
            assert self.local is not None, "only the gateway's own path stores responses"
            rec.model = owner.model
            if kind == CANCEL:
                return self.local.cancel(owner)
            if kind == DELETE:
                return await self.lookup(self.local.delete(owner))
            return self.local.retrieve(owner, request.query_params.get("stream") == "true")
        if kind == DELETE:
            raise ApiError(
                405,
                f"response '{response_id}' is stored by a vLLM server, which cannot delete responses",
                code="method_not_allowed",
                param="response_id",
                headers={"allow": "GET"},
            )
        if kind == CANCEL:
            method, path = "POST", f"/v1/responses/{response_id}/cancel"
        else:
            method, path = "GET", f"/v1/responses/{response_id}{query}"
            rec.stream = request.query_params.get("stream") == "true"
            if rec.stream and not owner.replayable:
                raise ApiError(
                    400,
                    f"response '{response_id}' was not created with both background and stream true, so it has "
                    "no events to stream again: retrieve it without stream=true",
                    param="stream",
                )
        w = self.holder(response_id, owner)
        rec.model = w.model or ""

        def attempt(w: Worker, headers: dict) -> Awaitable[Response]:
            return self.attempt(request, w, method, path, b"", headers, rec, False, None)

        return await self.forwarder.tries(rec, False, 0, lambda ex: w, attempt)

    async def previous(self, body: dict, tenant: str) -> StoredResponse | Owner | None:
        """The response a create continues (`previous_response_id`), where it is known; None
        when it continues none. A 400 for an id that is not one, a 404 for one not the
        tenant's anywhere."""
        previous = previous_id(body.get("previous_response_id"))
        return None if previous is None else await self.known(previous, tenant, "previous_response_id")

    async def known(self, response_id: str, tenant: str, param: str) -> StoredResponse | Owner:
        """Where `response_id` of `tenant` is known: the gateway's own response (its record),
        else vLLM's (its owner); a 404 naming `param` when neither knows it for the tenant."""
        if self.local is not None:
            record = await self.local_record(self.local, response_id, tenant)
            if record is not None:
                return record
        return await self.owned(response_id, tenant, param)

    async def local_record(self, local: LocalResponses, response_id: str, tenant: str) -> StoredResponse | None:
        """The response of kvgate's workers `response_id` of `tenant`, if the gateway stores one.
        Redis is asked only where neither this replica's store nor its ledger of vLLM's holds the
        id for the tenant: a vLLM response known here is served while Redis does not answer."""
        record = local.store.get(response_id, tenant)
        if record is not None:
            return await local.store.confirmed(record)
        known = self.ids.find(response_id)
        if known is not None and known.tenant == tenant:
            return None
        return await self.lookup(local.store.find(response_id, tenant))

    async def charged(
        self, request: Request, body: dict, raw: bytes, model: str, texts: list[str], estimated: bool, most: int | None
    ) -> bytes:
        """Charge the key for a create's input (`texts` by the model's tokenizer, with a quarter
        of the body's bytes when it holds `estimated` inputs, response_fields.input_texts) and
        its max_output_tokens (`most`), or without it the rest of the model's context (vLLM's
        default: it may generate that much), as a chat without max_tokens is charged; the body
        to forward, with the tenant's cache_salt."""
        intake = self.forwarder.intake
        key = api_key(request.scope)
        if key is not None and key.tpm:
            tok = await self.forwarder.tokenizers.get(model) if texts else None
            tokens = await input_tokens(tok, texts) + (len(raw) // 4 if estimated else 0)
            context = self.forwarder.fleet.models().get(model, 0)
            await intake.charge(request, tokens + (most if most is not None else max(0, context - tokens)))
        if intake.access.apply_cache_salt(key, body):
            return json.dumps(body).encode()
        return raw

    async def owned(self, response_id: str, tenant: str, param: str) -> Owner:
        """Who holds `response_id` for `tenant`: a 404 when the gateway knows of no such
        response of the tenant's (another's answers as an unknown one does)."""
        owner = await self.owner(response_id, tenant)
        if owner is None:
            raise ApiError(404, f"Response with id '{response_id[:200]}' not found.", code=NOT_FOUND, param=param)
        return owner

    def holder(self, response_id: str, owner: Owner) -> Worker:
        """The worker that stored `response_id` (`owner`'s): a 503 when it cannot take a request now."""
        w = self.forwarder.fleet.by_id(owner.worker_id)
        if w is None or not w.available:
            raise ApiError(
                503,
                f"the server that stored response '{response_id}' is unavailable now, and no other holds it; retry later",
                "server_error",
                UNAVAILABLE,
                retry_after=self.forwarder.admission.config.retry_after_s,
            )
        return w

    async def owner(self, response_id: str, tenant: str) -> Owner | None:
        """Who holds `response_id` for `tenant`: this replica's ledger, else (with Redis) the
        replicas'. Another tenant's entry here is a miss that asks Redis too, as an unknown id
        does, so that Redis failing answers both alike (else a 404 against a 503 tells which ids
        exist)."""
        if not valid_id(response_id):
            return None
        owner = self.ids.find(response_id)
        if owner is not None and owner.tenant == tenant:
            return owner
        if self.shared is None:
            return None
        found = await self.lookup(self.shared.find(response_id))
        if found is None:
            return None
        self.ids.record(response_id, found[0], found[1])
        return found[0] if found[0].tenant == tenant else None

    async def lookup(self, lookup: Awaitable[T]) -> T:
        """`lookup`'s result; Redis not answering it (LookupFailed) is a 503: another replica may
        hold the response, so "unknown" would tell the client it is gone."""
        try:
            return await lookup
        except LookupFailed as e:
            raise ApiError(
                503,
                f"cannot look the response up: {e}",
                "server_error",
                LOOKUP_FAILED,
                retry_after=self.forwarder.admission.config.retry_after_s,
            )

    def record(self, response_id: str, owner: Owner) -> Awaitable[None] | None:
        """Remember (and share) which worker and tenant a response is; an id the ledger cannot
        hold (valid_id) is logged and left out: its follow-ups will be 404s. Returns what the
        id's bytes wait for (the shared write: gateway/shared_response_ids.py), or None."""
        if not self.ids.record(response_id, owner):
            log.warning(
                "worker %s answered a response id the gateway cannot record: %r", owner.worker_id, response_id[:200]
            )
        elif self.shared is not None:
            return self.shared.put(response_id, owner, self.ids.ttl_s)
        return None

    def pick(self, model: str, exclude: set[str]) -> Worker | None:
        """The least loaded vLLM worker of `model` (not in `exclude`) whose queue has room; a 503
        `overloaded` when every one is full."""
        fwd = self.forwarder
        workers = [w for w in fwd.fleet.candidates(model) if w.worker_id not in exclude and w.kind == vllm_worker.KIND]
        room = fwd.admission.open_workers(workers)
        if workers and not room:
            fwd.metrics.refused.labels("worker_queues_full").inc()
            raise refused(fwd.admission.full(len(workers)))
        if not room:
            return None
        return cheapest(random.getrandbits(32), room, [v.load for v in fwd.fleet.views(room, {})])

    def with_room(self, w: Worker) -> Worker:
        """`w` if its queue has room, else a 503 `overloaded` (no other worker can serve it)."""
        fwd = self.forwarder
        if not fwd.admission.open_workers([w]):
            fwd.metrics.refused.labels("worker_queues_full").inc()
            raise refused(fwd.admission.full(1))
        return w

    async def attempt(
        self,
        request: Request,
        w: Worker,
        method: str,
        path: str,
        raw: bytes,
        headers: dict,
        rec: RequestRecord,
        engine: bool,
        keep: str | None,
        whole: bool = False,
        replayable: bool = False,
    ) -> Response:
        """One try on `w`: UpstreamError while nothing is committed to the client, else its
        answer, relayed as it arrives. A 404 that is not an OpenAI error (no such route) or a
        501 (vLLM serves no Responses API for the model) is the client's 400
        `model_not_supported`; a 503 is the worker's load and any other 5xx its failure.
        `engine`: a create, engine work, else a retrieve or cancel, whose broken answer says
        nothing of the worker (the client steers it: `Forwarder.ends`); `whole`: one answered
        only once generated, so bounded by the answer timeout (gateway/proxy.py). A stream's
        silence is bounded by the first-byte timeout until its first event past the opening
        ones, by the idle timeout after (response_tap.Opening). A 200 answer's id is recorded
        for tenant `keep` (None: not recorded), `replayable` or not, as it passes."""
        fwd = self.forwarder
        sent = raw if method == "POST" else None
        resp = await fwd.proxy.open(w.url, path, sent, headers, request, fwd.fleet.lost(w), whole, method)
        kind = resp.headers.get("content-type", "application/json")
        out = {"x-kvgate-worker": w.worker_id, "content-type": kind}
        if resp.status in UNSERVED:
            return await fwd.unserved(w, resp, engine, out, not_supported(rec.model))
        if resp.status >= 500:
            await whole_body(fwd.proxy, resp)  # raises: WorkerBusy (503) or WorkerError
        failed, closed = fwd.ends(w, resp, engine, rec, steered=not engine)
        taps: list[Callable[[bytes], None]] = []
        idle = fwd.proxy.idle_timeout
        streamed = kind.startswith("text/event-stream")
        if streamed:
            out["cache-control"] = "no-cache"
            taps.append(Opening(lambda: resp.bound_idle(fwd.proxy.idle_timeout)))
            idle = fwd.proxy.first_byte_timeout
        if keep is None or resp.status != 200:
            return TappedPassThrough(resp, resp.status, idle, failed, closed, out, taps)
        tap = IdTap(streamed, lambda rid: self.record(rid, Owner(w.worker_id, keep, replayable)))

        def ended() -> None:
            if tap.id is None and resp.complete:
                log.warning("worker %s answered a response whose id the gateway did not find", w.worker_id)
            closed()

        return TappedPassThrough(resp, 200, idle, failed, ended, out, [tap, *taps])


def not_supported(model: str) -> ApiError:
    return ApiError(
        400,
        f"The model `{model}` serves no Responses API (/v1/responses): its workers do not serve it "
        "(a vLLM server of a pooling model)",
        code=NOT_POOLING,
        param="model",
    )
