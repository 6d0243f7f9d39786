"""`kvgate gateway`'s command line: where it listens, its workers and policy, and the liveness,
timeout, retry, admission and client-limit settings (gateway/server.py builds from them)."""

import argparse
import os

from policies.api import DEFAULT_TIER_CREDITS
from workers.cli_help import HelpFormatter
from gateway.response_ids import DEFAULT_SIZE, DEFAULT_TTL_S
from gateway.shared_response_store import DEFAULT_MB
from workers.http_guard import DEFAULT_MAX_BODY_BYTES
from workers.http_server import add_client_args
from workers.logs import add_log_args
from workers.telemetry import add_trace_args

DESCRIPTION = "`kvgate gateway`: the KV-aware OpenAI gateway in front of a worker fleet."


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate gateway", description=DESCRIPTION, formatter_class=HelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="a worker's base URL (repeatable); `vllm:URL` (or `sglang:URL`) for a vLLM server "
        "publishing KV events (README: In front of vLLM); with --redis, more are discovered",
    )
    p.add_argument(
        "--vllm-profile",
        metavar="PATH",
        help="cost model of the vLLM workers (`kvgate calibrate --url VLLM_URL --out PATH`), for "
        "slo_goodput; without it their TTFT/TPOT are predicted by the default model",
    )
    p.add_argument(
        "--policy",
        default="prefix_affinity",
        help="built-in name (round_robin, least_load, prefix_affinity, kv_cost, slo_goodput), "
        "module:Class, path/to/file.py:Class, or a kvgate.policies entry point",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="PATH|ALIAS",
        help="tokenizer and chat template of a served model (repeatable; the first is the "
        "default); other models of the fleet load by alias on first use",
    )
    p.add_argument(
        "--redis",
        metavar="URL",
        default=os.environ.get("KVGATE_REDIS_URL"),
        help="discover workers, residency, shared load and rate limits in Redis "
        "(redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS; default: $KVGATE_REDIS_URL); "
        "needs --internal-token",
    )
    p.add_argument(
        "--internal-token",
        default=os.environ.get("KVGATE_INTERNAL_TOKEN"),
        help="the fleet's shared secret (default: $KVGATE_INTERNAL_TOKEN): verifies workers' "
        "registrations in Redis, and is sent to kvgate workers on P/D legs and with the prompts' "
        "token ids (kv_prompt_ids, so they need not tokenize again); without it requests are "
        "never disaggregated and workers tokenize every prompt themselves",
    )
    p.add_argument("--block-size", type=int, default=16, help="KV block size the workers use")
    p.add_argument("--slo-ttft-ms", type=float, help="TTFT SLO for requests without x-slo-ttft-ms")
    p.add_argument("--slo-tpot-ms", type=float, help="TPOT SLO for requests without x-slo-tpot-ms")
    p.add_argument(
        "--health-interval",
        type=float,
        default=0.5,
        help="seconds between /state polls; a worker is out after one failed poll",
    )
    p.add_argument(
        "--pd-min-uncached-tokens",
        type=int,
        metavar="N",
        help="P/D-aware policies (prefix_affinity, kv_cost, slo_goodput) disaggregate only when the best "
        "decode/mixed worker lacks at least N prompt tokens; shorter prefills run on the decode worker (default 512)",
    )
    p.add_argument(
        "--pd-wait-ms",
        type=float,
        default=5000.0,
        help="how long a decode leg waits for its KV blocks before computing them itself",
    )
    p.add_argument(
        "--policy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="constructor argument for the policy (repeatable; numbers are parsed)",
    )
    add_trace_args(p)
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a client API key (repeatable; each its own tenant); clients send `Authorization: "
        "Bearer KEY`, others get a 401. /health and /metrics stay open",
    )
    p.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="client API keys: one a line, or a JSON list of {key, name, tenant, cache_salt, rpm, tpm, "
        "client_cache_salt} (repeatable); keeps keys out of the process list",
    )
    p.add_argument(
        "--rate-limit-rpm",
        type=int,
        metavar="N",
        help="requests per minute per API key, for keys without their own rpm (shared by replicas through --redis)",
    )
    p.add_argument(
        "--rate-limit-tpm",
        type=int,
        metavar="N",
        help="tokens (prompt + max_tokens) per minute per API key, for keys without their own tpm",
    )
    p.add_argument(
        "--hide-cache-headers",
        action="store_true",
        help="do not send the x-kvgate-* routing headers (worker, policy, predicted cached tokens) "
        "to clients: they reveal what other clients' prompts put in the cache",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help="largest request body taken, checked before it is read (larger: 413)",
    )
    p.add_argument("--replica-id", help="this gateway's id among replicas sharing Redis (default: random)")
    p.add_argument(
        "--response-ids",
        type=int,
        default=DEFAULT_SIZE,
        metavar="N",
        help="stored Responses API responses (/v1/responses) the gateway remembers, the least recently used "
        "forgotten first: of a vLLM worker's, which worker holds it (its follow-ups, retrieves and cancels go "
        "there); of kvgate's workers, the response and its conversation, which the gateway keeps (with --redis "
        "shared by the replicas); a forgotten one is a 404",
    )
    p.add_argument(
        "--response-ttl-s",
        type=float,
        default=DEFAULT_TTL_S,
        metavar="S",
        help="how long the gateway remembers a stored response after its creation",
    )
    p.add_argument(
        "--response-store-mb",
        type=float,
        default=DEFAULT_MB,
        metavar="MB",
        help="the most memory the responses the gateway keeps for kvgate's workers take (each held as its JSON), the "
        "least recently used of the tenant holding the most forgotten first",
    )
    p.add_argument(
        "--response-store-ids-per-tenant",
        type=int,
        metavar="N",
        help="the most responses one tenant may have the gateway keep for kvgate's workers, in each replica's memory "
        "and (with --redis) in Redis: past it the tenant's own least recently used (in Redis: oldest) are forgotten, "
        "never another tenant's (default: a quarter of --response-ids with API keys, all of it without: every "
        "response is then one tenant's)",
    )
    p.add_argument(
        "--response-store-mb-per-tenant",
        type=float,
        metavar="MB",
        help="the most memory one tenant's responses kept for kvgate's workers may take, in each replica's memory "
        "and (with --redis) in Redis, as --response-store-ids-per-tenant counts them (default: a quarter of "
        "--response-store-mb with API keys, all of it without)",
    )
    add_log_args(p)
    p.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="no access-log line per request (by default one, logger kvgate.access, at INFO whatever --log-level)",
    )
    p.add_argument(
        "--fleet-summary-s",
        type=float,
        default=60.0,
        metavar="S",
        help="a fleet summary line (kvgate.fleet) every S seconds: workers, requests, SLO attainment, "
        "hit ratio, TTFT; 0 turns it off",
    )
    add_reliability_args(p)
    return p


def add_reliability_args(p: argparse.ArgumentParser) -> None:
    """Liveness, upstream timeouts, retries, admission control and client limits."""
    g = p.add_argument_group("liveness and upstream")
    g.add_argument(
        "--host-kv-credit",
        type=float,
        default=DEFAULT_TIER_CREDITS.host,
        metavar="C",
        help="what a matched block in a worker's host tier is worth, in device blocks (its copy back "
        "runs beside the worker's steps: it saves the whole prefill and delays only its own request)",
    )
    g.add_argument(
        "--host-kv-gbps",
        type=float,
        default=DEFAULT_TIER_CREDITS.host_gbps,
        metavar="G",
        help="how fast a worker copies its host tier back to the device (GB/s), for workers whose /state "
        "does not say (vLLM's): kvgate workers publish their own --host-kv-gbps, which wins. A host hit's "
        "copy, its bytes from the worker's KV bytes per token, delays that request's predicted TTFT where "
        "it outlasts the queue ahead",
    )
    g.add_argument(
        "--disk-kv-credit",
        type=float,
        default=DEFAULT_TIER_CREDITS.disk,
        metavar="C",
        help="what a matched block in a worker's disk tier is worth, in device blocks (its read back "
        "runs beside the worker's steps, as a host block's copy does)",
    )
    g.add_argument(
        "--disk-kv-gbps",
        type=float,
        default=DEFAULT_TIER_CREDITS.disk_gbps,
        metavar="G",
        help="how fast a worker reads its disk tier back to the device (GB/s), for workers whose /state "
        "does not say: kvgate workers publish their own --disk-kv-gbps, which wins. A disk hit's read "
        "delays that request's predicted TTFT where it outlasts the queue ahead",
    )
    g.add_argument(
        "--engine-stall-s",
        type=float,
        default=1.5,
        help="a worker whose engine made no progress on its work for this long is out of service",
    )
    g.add_argument(
        "--upstream-connect-timeout", type=float, default=2.0, metavar="S", help="seconds to connect to a worker"
    )
    g.add_argument(
        "--upstream-first-byte-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds until a stream's first token, or the answer of a P/D prefill leg, a tokenization or "
        "a pooling request (none more work than a prefill)",
    )
    g.add_argument(
        "--upstream-answer-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="seconds for a whole non-streaming completion or chat answer, which comes only after its last "
        "token; past it the client gets 504 `worker_timeout` and the request is not sent to another worker "
        "(a hung worker is taken out sooner by liveness: --health-interval, --engine-stall-s)",
    )
    g.add_argument(
        "--upstream-idle-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="longest silence of a worker inside an answer (between stream events)",
    )
    g.add_argument(
        "--max-retries",
        type=int,
        default=2,
        help="other workers a request may go to when one fails before its answer is committed",
    )
    g.add_argument(
        "--retry-backoff-ms",
        type=float,
        default=50.0,
        help="wait before the first retry; doubles with each, with jitter, up to 1 s",
    )
    g.add_argument(
        "--breaker-failures",
        type=int,
        default=3,
        help="consecutive failed requests that open a worker's circuit breaker",
    )
    g.add_argument(
        "--breaker-cooldown-s",
        type=float,
        default=2.0,
        help="how long an open breaker keeps a worker out before one trial (doubles per reopening)",
    )
    g = p.add_argument_group("admission control")
    g.add_argument(
        "--max-pending", type=int, default=1024, help="requests the gateway holds at once; beyond, 503 overloaded"
    )
    g.add_argument(
        "--max-queue-per-worker",
        type=int,
        default=32,
        help="requests a worker may have waiting beyond its running batch; a full worker gets no "
        "more, and when all are full the request is refused (503 overloaded)",
    )
    g.add_argument("--retry-after-s", type=int, default=1, help="Retry-After of 503/429 refusals")
    g = p.add_argument_group("client connections")
    add_client_args(g)
    g.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long requests in flight may take to finish before the gateway exits",
    )
