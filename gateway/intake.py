"""The gateway's intake of a request: its body parsed and checked as a worker would, its model
resolved, its prompt tokenized and hashed, its key charged for tokens, and the policy's
`RequestView` of it. Anything wrong is an `ApiError`, answered in OpenAI's shape."""

import json

from starlette.requests import Request

from gateway import vllm_worker
from gateway.admission import Refusal
from gateway.auth import Access, api_key, retry_after, too_many_tokens
from gateway.fleet import Fleet
from gateway.worker import KVGATE
from gateway.passthrough import internal_field
from gateway.proxy import AnswerTimeout
from gateway.tap import ask_usage
from gateway.record import RequestRecord
from gateway.tokenize import Prepared, Tokenizers
from policies.api import RequestView
from policies.candidates import NO_WORKERS
from workers.given_ids import FIELD as GIVEN_IDS
from workers.given_ids import field_value, has_text
from workers.protocol import check_request, checked_cache_salt
from workers.sampling_params import InvalidRequest
from workers.strict_json import loads


class ApiError(Exception):
    """An error answered to the client as an OpenAI error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type_, code, param
        self.retry_after, self.headers = retry_after, headers or {}


def refused(r: Refusal) -> ApiError:
    return ApiError(r.status, r.message, "server_error", r.code, retry_after=r.retry_after_s)


def worker_failed(tries: int, last: Exception | None, retry_after_s: int) -> ApiError:
    """The gateway's 502 once every worker tried failed a request (`last`: the last failure),
    or its 504 when the last was a whole answer past the answer timeout (not retried)."""
    if isinstance(last, AnswerTimeout):
        return ApiError(504, f"no answer in time: {last}", "server_error", "worker_timeout")
    return ApiError(
        502,
        f"no worker could serve the request after {tries} tries; last: {last}",
        "server_error",
        "worker_failed",
        retry_after=retry_after_s,
    )


def client_body(raw: bytes) -> dict:
    """A client's body as a JSON object (strictly parsed) setting no field internal to the
    fleet; raises ApiError."""
    try:
        body = loads(raw)
    except InvalidRequest as e:
        raise ApiError(400, str(e), code=e.code, param=e.param)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if (field := internal_field(body)) is not None:
        raise ApiError(
            400, f"'{field}' is internal to the fleet: clients may not set it", param=field, code="internal_field"
        )
    return body


class Intake:
    """What the gateway reads a request with: the fleet (served models), the tokenizers, the
    access rules (cache salt, token budgets) and the default SLOs."""

    def __init__(
        self,
        fleet: Fleet,
        tokenizers: Tokenizers,
        access: Access,
        slo_ttft_ms: float | None,
        slo_tpot_ms: float | None,
        send_ids: bool = False,
    ):
        self.fleet, self.tokenizers, self.access = fleet, tokenizers, access
        self.slo_ttft_ms, self.slo_tpot_ms = slo_ttft_ms, slo_tpot_ms
        self.send_ids = send_ids  # the gateway has the fleet's token, which kv_prompt_ids needs

    async def prepare(
        self, request: Request, raw: bytes, kind: str, rec: RequestRecord
    ) -> tuple[str, Prepared | None, RequestView, bytes]:
        """Body -> (model, tokenized request, the policy's request view, the body to forward:
        with the tenant's cache_salt, a stream's usage asked for, and for a fleet of kvgate
        workers the prompts' ids, `kv_prompt_ids`); raises ApiError."""
        body = client_body(raw)
        if self.access.apply_cache_salt(api_key(request.scope), body):
            raw = json.dumps(body).encode()
        models = self.fleet.models()
        model = self.resolve_model(body.get("model"), models)
        tok = await self.tokenizers.get(model)
        prep = None
        kinds = {w.kind for w in self.fleet.candidates(model)}
        whole = kinds == {vllm_worker.KIND}  # gateway/passthrough.py
        try:
            if tok is not None:
                defaults = self.fleet.generation_defaults(model)
                prep = await self.tokenizers.prepare(tok, body, kind, len(raw), models[model], whole, defaults)
            elif not whole:
                check_request(body, kind)
            else:  # vLLM checks its fields; the salt is the tenant's boundary, checked here
                checked_cache_salt(body)
        except InvalidRequest as e:
            raise ApiError(400, str(e), code=e.code, param=e.param)
        rec.stream = body.get("stream") is True
        view = self.request_view(request, body, kind, model, prep, len(raw), rec.request_id)
        changed = rec.hide_usage = ask_usage(body)  # the stream's usage event is the gateway's count of its tokens
        ours = self.send_ids and kinds == {KVGATE}
        if ours and prep is not None and tok is not None and tok.fingerprint and has_text(body, kind):
            body[GIVEN_IDS] = field_value(tok.fingerprint, prep.parsed.prompts)  # the worker need not tokenize again
            changed = rec.ids_sent = True
        return model, prep, view, json.dumps(body).encode() if changed else raw

    async def admit_tokens(self, request: Request, view: RequestView, prep: Prepared | None) -> None:
        """Charge the request's key for its prompt and max_tokens (as asked: `Prepared.asked_tokens`);
        a 429 when the key's tokens-per-minute budget is spent."""
        await self.charge(request, view.num_tokens + (prep.asked_tokens if prep is not None else view.max_tokens))

    async def charge(self, request: Request, tokens: int, embeddings: bool = False) -> None:
        """Take `tokens` from the request's key's tokens-per-minute budget; a 429 when it is spent
        (`embeddings`: the tokens are an embeddings request's inputs)."""
        key = api_key(request.scope)
        wait = await self.access.admit_tokens(key, tokens)
        if wait and key is not None:
            raise ApiError(
                429,
                too_many_tokens(key, tokens, wait, embeddings),
                "rate_limit_error",
                "rate_limit_exceeded",
                retry_after=retry_after(wait),
            )

    def resolve_model(self, model: object, models: dict[str, int]) -> str:
        """The served model a request names (required, as in OpenAI's schema)."""
        if model is None:
            raise ApiError(400, "'model' is required (GET /v1/models lists the served ones)", param="model")
        if not models:
            raise ApiError(503, NO_WORKERS, "server_error", "no_healthy_workers")
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", param="model")
        if model not in models:
            raise ApiError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")
        return model

    def request_view(
        self, request: Request, body: dict, kind: str, model: str, prep: Prepared | None, size: int, rid: str
    ) -> RequestView:
        h = request.headers
        session = h.get("x-session-id") or body.get("session_id") or body.get("user")
        return RequestView(
            request_id=rid,
            num_tokens=prep.num_tokens if prep else size // 4,
            block_hashes=tuple(prep.hashes) if prep else (),
            max_tokens=prep.max_tokens if prep else 16,
            choices=prep.parsed.num_choices if prep else 1,
            slo_ttft_ms=_slo(h, "x-slo-ttft-ms", self.slo_ttft_ms),
            slo_tpot_ms=_slo(h, "x-slo-tpot-ms", self.slo_tpot_ms),
            session_id=str(session) if session is not None else None,
            model=model,
        )


MAX_SLO_MS = 86_400_000.0  # a day: a longer SLO is none, and inf or 1e308 would turn the headroom math to NaN


def _slo(headers, name: str, default: float | None) -> float | None:
    """A client's SLO header in ms, in (0, MAX_SLO_MS]; 400 otherwise."""
    v = headers.get(name)
    if v is None:
        return default
    try:
        ms = float(v)
    except ValueError:
        ms = -1.0
    if not 0 < ms <= MAX_SLO_MS:
        raise ApiError(400, f"header {name} must be a number of milliseconds in (0, {MAX_SLO_MS:.0f}]", param=name)
    return ms
