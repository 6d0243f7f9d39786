"""What the gateway forwards without a routing decision: vLLM's `POST /tokenize` and
`POST /detokenize`, and the pooling endpoints for a model served by vLLM workers: OpenAI's
`POST /v1/embeddings` and vLLM's `/v2/embed` (Cohere's), `/pooling`, `/classify`, `/score`,
`/v1/score`, `/rerank`, `/v1/rerank` and `/v2/rerank` (Jina's and Cohere's), one family of kinds
(`POOLING_KINDS`) sharing one code path: "an embedding" below is any of them.

No KV cache is matched for these (a tokenization caches nothing; an embedding's prompt is not a
prefix any later request reuses), so each goes to the least loaded healthy worker of its model,
ties spread at random. It goes through the completions' upstream client: its connect,
first-byte and idle timeouts, a retry on another worker after the backoff when one fails before
answering (each failure counted by stage), a worker's 503 (its load) tried elsewhere and its
answer the client's when nowhere is left, every other 5xx the gateway's own 502. Once a
worker's answer has started it is relayed to the client as it arrives, never held whole (a
worker silent past the idle timeout, or breaking off, then cuts the client's connection:
`Forwarder.attempt`). The request carries the gateway's request id (`x-request-id`, which vLLM
keys the request by ahead of a body's `request_id`) and never the fleet's token. The body is the
client's own bytes, unless the tenant's `cache_salt` was set in it (pooling); every field
internal to the fleet is refused (`gateway/passthrough.py`), and the body cap, admission control
and a key's request rate apply as to completions (`gateway/auth.py` `LIMITED_PATHS`).

**/tokenize and /detokenize are forwarded to a worker, not answered with the gateway's own
tokenizer**, although the gateway tokenizes completions exactly as kvgate's workers do (one parse,
`workers/protocol.py`). Only the serving engine's answer is exact for both worker kinds:

- a vLLM server renders what kvgate's parse refuses (`tools`, a request's own `chat_template`,
  multimodal content, `mm_processor_kwargs`, `media_io_kwargs`), with its own `--chat-template`
  and tokenizer mode, which the gateway cannot see: the gateway would refuse such a request, or
  answer ids that server would not use;
- `max_model_len` in the answer is the worker's own context;
- a model whose tokenizer the gateway cannot load (a path only the workers have) is routed
  cache-blind, and still tokenizes.

A kvgate worker answers /tokenize from the very parse the gateway would run, in a thread, so the
cost of forwarding is one hop; a tokenization takes no engine step, so it is not counted as load
(`Fleet.begin`), and a full worker's queue does not keep it from one. Nor does it tell the
worker's circuit breaker (gateway/breaker.py), which guards the engine, of its success: an
engine that fails every generation while its server still tokenizes must open it, so a
tokenization goes only to a worker whose breaker is closed (never takes a half-open one's
single trial), does not close or reset a breaker by succeeding, and counts against it only
when the worker could not be reached or broke its answer off (`Exchange.worker_failed`); a
worker's 5xx to it is still retried elsewhere. An embedding runs in vLLM's engine: it is counted
in flight while it runs, goes only to a worker whose queue has room, takes a half-open breaker's
trial and reports its outcome to the breaker as a completion does, and its input's tokens are
charged to a key's tokens-per-minute budget (token ids counted, text by the gateway's tokenizer
for the model, or a byte estimate as for a model routed cache-blind; a score's or rerank's every
pair, a query paired with N documents N times; conversations, multimodal parts and a plugin's
data at a quarter of the body's bytes). Its main inputs' shapes are checked first
(gateway/pooling.py), the rest left to vLLM.

kvgate's own workers do not pool: a model with none but kvgate workers is a 400
(`model_not_supported`), as is a vLLM server's bare 404 for a pooling path (a generative model
mounts no such route), rather than that 404 page.

These requests are not counted in `kvgate_gateway_requests` and the SLO series: those have no
endpoint label and mean generation (a 1 ms tokenization would read as a met SLO, an embedding
as a request of the model's traffic); each still has its access-log line (`kind`) and trace, and
its worker failures, retries and admission refusals are counted as every request's are.
"""

import json
import random
import uuid
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway import vllm_worker
from gateway.admission import Admission
from gateway.auth import api_key
from gateway.breaker import CLOSED
from gateway.exchange import Exchange, whole_body
from gateway.fleet import Fleet
from gateway.intake import ApiError, Intake, client_body, refused
from gateway.metrics import GatewayMetrics
from gateway.pooling import (
    CLASSIFY,
    EMBED,
    EMBEDDINGS,
    POOLING,
    POOLING_KINDS,
    RERANK,
    RERANK_V1,
    RERANK_V2,
    SCORE,
    SCORE_V1,
    SERVES,
    input_tokens,
    pooling_inputs,
)
from gateway.proxy import Proxy, UpstreamTimeout
from gateway.relay import BodyPassThrough
from gateway.record import RequestRecord
from gateway.retry import RetryPolicy, Tries, Way
from gateway.tokenize import Tokenizers
from gateway.upstream import Upstream
from gateway.worker import Worker
from policies.candidates import cheapest

TOKENIZE, DETOKENIZE = "tokenize", "detokenize"
PATHS = {
    TOKENIZE: "/tokenize",
    DETOKENIZE: "/detokenize",
    EMBEDDINGS: "/v1/embeddings",
    EMBED: "/v2/embed",
    POOLING: "/pooling",
    CLASSIFY: "/classify",
    SCORE: "/score",
    SCORE_V1: "/v1/score",
    RERANK: "/rerank",
    RERANK_V1: "/v1/rerank",
    RERANK_V2: "/v2/rerank",
}
ID_PREFIX = {
    TOKENIZE: "tok-",
    DETOKENIZE: "detok-",
    EMBEDDINGS: "embd-",
    EMBED: "embd-",
    POOLING: "pool-",
    CLASSIFY: "classify-",
    SCORE: "score-",
    SCORE_V1: "score-",
    RERANK: "rerank-",
    RERANK_V1: "rerank-",
    RERANK_V2: "rerank-",
}
NOT_POOLING = "model_not_supported"


def new_id(kind: str) -> str:
    return ID_PREFIX[kind] + uuid.uuid4().hex[:24]


class Forwarder:
    """Serves the forwarded endpoints with the gateway's fleet, upstream client, admission
    control, retry policy, metrics and client intake."""

    def __init__(
        self,
        fleet: Fleet,
        proxy: Proxy,
        admission: Admission,
        retry: RetryPolicy,
        metrics: GatewayMetrics,
        exchange: Exchange,
        intake: Intake,
        tokenizers: Tokenizers,
    ):
        self.fleet, self.proxy, self.admission, self.retry = fleet, proxy, admission, retry
        self.metrics, self.exchange, self.intake, self.tokenizers = metrics, exchange, intake, tokenizers
        self.retries = Tries(retry, metrics, exchange, admission)

    async def serve(self, request: Request, kind: str, raw: bytes, rec: RequestRecord) -> Response:
        """Check the body, then forward it; raises ApiError."""
        body = client_body(raw)
        model = rec.model = self.intake.resolve_model(body.get("model"), self.fleet.models())
        rec.trace.set(model=model)
        if kind in POOLING_KINDS:
            raw = await self.pooling(request, kind, body, raw, model)
        return await self.forward(request, kind, raw, model, rec)

    async def pooling(self, request: Request, kind: str, body: dict, raw: bytes, model: str) -> bytes:
        """A pooling body (embeddings, a score, a rerank...) checked, its model one a vLLM worker
        serves, its inputs' tokens charged (texts by the model's tokenizer, token ids counted,
        what `pooling_inputs` cannot extract texts from at a quarter of the body's bytes); the
        body to forward (with the tenant's cache_salt)."""
        kinds = {w.kind for w in self.fleet.workers.values() if w.model == model and w.healthy}
        if vllm_worker.KIND not in kinds:
            raise not_pooling(model, kind)
        texts, ids, estimated = pooling_inputs(kind, body)
        key = api_key(request.scope)
        if key is not None and key.tpm:
            tok = await self.tokenizers.get(model) if texts else None
            tokens = await input_tokens(tok, texts)
            await self.intake.charge(request, tokens + ids + (len(raw) // 4 if estimated else 0), embeddings=True)
        if self.intake.access.apply_cache_salt(key, body):
            return json.dumps(body).encode()
        return raw

    def pick(self, model: str, kind: str, exclude: set[str]) -> Worker | None:
        """The least loaded candidate of `model` (not in `exclude`) that can serve `kind`; for
        a pooling kind (embeddings, a score...), a vLLM worker whose queue has room (none: 503 `overloaded`); for a
        tokenization, one whose breaker is closed (a half-open one's single trial is a
        request of its engine's)."""
        workers = [w for w in self.fleet.candidates(model) if w.worker_id not in exclude]
        if kind not in POOLING_KINDS:
            workers = [w for w in workers if w.breaker.state == CLOSED]
        else:
            workers = [w for w in workers if w.kind == vllm_worker.KIND]
            room = self.admission.open_workers(workers)
            if workers and not room:
                self.metrics.refused.labels("worker_queues_full").inc()
                raise refused(self.admission.full(len(workers)))
            workers = room
        if not workers:
            return None
        views = self.fleet.views(workers, {})
        return cheapest(random.getrandbits(32), workers, [v.load for v in views])

    async def forward(self, request: Request, kind: str, raw: bytes, model: str, rec: RequestRecord) -> Response:
        """The body to the least loaded worker, retried elsewhere as `tries` says."""

        def attempt(w: Worker, headers: dict) -> Awaitable[Response]:
            return self.attempt(request, w, kind, raw, headers, rec)

        return await self.tries(
            rec, kind in POOLING_KINDS, self.retry.max_retries, lambda ex: self.pick(model, kind, ex), attempt
        )

    async def tries(
        self,
        rec: RequestRecord,
        engine: bool,
        retries: int,
        pick: Callable[[set[str]], Worker | None],
        attempt: Callable[[Worker, dict], Awaitable[Response]],
    ) -> Response:
        """Tries on the workers `pick` offers (given those that failed), retried as
        `Tries.run` says (gateway/retry.py), each sent with the gateway's request id and
        traced. `engine`: the request is engine work, counted in flight and in the worker's
        breaker."""
        headers = {"content-type": "application/json", "x-request-id": rec.request_id}

        async def traced(w: Worker) -> Response:
            with rec.trace.client("upstream", headers, None, worker=w.worker_id) as sent:
                return await attempt(w, sent)

        if not engine:
            return await self.retries.run(rec, retries, Way(pick, traced, worker_header, engine=False))
        return await self.retries.run(rec, retries, Way(pick, traced, worker_header, self.fleet.begin, self.fleet.end))

    async def attempt(
        self, request: Request, w: Worker, kind: str, raw: bytes, headers: dict, rec: RequestRecord
    ) -> Response:
        """One try on `w`: UpstreamError while nothing is committed to the client, else its
        answer. **Relayed, not read whole**: once the head is in, the body goes to the client
        as it arrives (`BodyPassThrough`: an idle timeout per chunk, no retry after the head,
        nothing held in memory; an embeddings answer of 2048 inputs of a 4096-dimension model
        is ~170 MB of JSON). Only what the gateway must read before it answers is read whole,
        and is small: a 5xx (a 503 is the worker's load, any other its failure: retried
        elsewhere) and a pooling request's UNSERVED answer (`unserved`)."""
        resp = await self.proxy.open(w.url, PATHS[kind], raw, headers, request, self.fleet.lost(w))
        engine = kind in POOLING_KINDS
        out = {"x-kvgate-worker": w.worker_id, "content-type": resp.headers.get("content-type", "application/json")}
        if engine and resp.status in UNSERVED:
            return await self.unserved(w, resp, engine, out, not_pooling(rec.model, kind))
        if resp.status >= 500:
            await whole_body(self.proxy, resp)  # raises: WorkerBusy (503) or WorkerError
        return self.relay(w, resp, engine, out, rec)

    async def unserved(self, w: Worker, resp: Upstream, engine: bool, out: dict, refusal: ApiError) -> Response:
        """A vLLM server's answer that it does not serve the endpoint for its model (UNSERVED):
        the server answered as it should (its breaker is told so for engine work), and the client
        gets `refusal` (a 400 `model_not_supported`), or vLLM's own OpenAI 404 (an unknown model,
        a missing response) as it is."""
        body = await self.proxy.read(resp)
        if engine:
            w.breaker.succeeded()
        if resp.status == 404 and _openai_error(body):
            return Response(body, 404, out)
        raise refusal

    def relay(self, w: Worker, resp: Upstream, engine: bool, headers: dict, rec: RequestRecord) -> BodyPassThrough:
        """`resp`'s body relayed to the client, ended as `ends` says."""
        failed, closed = self.ends(w, resp, engine, rec)
        return BodyPassThrough(resp, resp.status, self.proxy.idle_timeout, failed, closed, headers)

    def ends(
        self, w: Worker, resp: Upstream, engine: bool, rec: RequestRecord, steered: bool = False
    ) -> tuple[Callable[[Exception], str], Callable[[], None]]:
        """The callbacks of a relayed answer's failure and end (`BodyPassThrough`). Its end is
        the try's: the worker's count in flight ends, and for an embedding (engine work) the
        breaker is told of its success, its failure or nothing (the client left); a
        tokenization's failure counts against the breaker only when the worker broke the answer
        off, not when it fell silent. A `steered` answer's failure (one the client shapes: a
        stored response's retrieve or cancel, which vLLM breaks off for some queries) is counted
        in the metrics only, neither in the breaker nor as suspect: else any client could take
        a worker out for everyone."""
        rec.status = resp.status
        broken = False

        def failed(e: Exception) -> str:
            nonlocal broken
            broken, rec.status = True, 502
            self.metrics.upstream_failures.labels(w.model or "", w.worker_id, "stream").inc()
            silent = isinstance(e, UpstreamTimeout)
            if (engine or not silent) and not steered:
                w.breaker.failed()
            if not (silent or steered):  # broken off: likely dead until its next good poll
                self.fleet.mark_suspect(w, str(e))
            return f"worker {w.worker_id} failed: {e}"

        def closed() -> None:
            if engine:
                self.fleet.end(w)
                if not broken and resp.complete:
                    w.breaker.succeeded()
                elif not broken:  # the client left before the end
                    w.breaker.released()
            self.exchange.account.finish(rec)

        return failed, closed


# A server's answers that it does not serve an endpoint for its model: no such route (a bare 404
# page), or vLLM 0.32's 501 "The model does not support ... API" where the route is mounted.
UNSERVED = (404, 501)


def worker_header(w: Worker | None) -> dict[str, str]:
    """The worker a forwarded request's own answer (a 499) is about; none on a worker's 503."""
    return {"x-kvgate-worker": w.worker_id} if w is not None else {}


def not_pooling(model: str, kind: str) -> ApiError:
    what = SERVES.get(kind, "scores" if kind in (SCORE, SCORE_V1) else "reranking")
    return ApiError(
        400,
        f"The model `{model}` serves no {what} ({PATHS[kind]}): only vLLM workers serving a pooling model "
        "of that task do (kvgate's own workers generate text only)",
        code=NOT_POOLING,
        param="model",
    )


def _openai_error(body: bytes) -> bool:
    """Whether a body is an OpenAI error object (not a bare 404 page)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("error"), dict)
