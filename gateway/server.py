"""`kvgate gateway`: the KV-aware OpenAI gateway in front of a worker fleet (its flags: gateway/cli_args.py)."""

import argparse
import contextlib
import json
import math
import os
import socket
import sys
from collections.abc import Callable

from starlette.applications import Starlette

from gateway import vllm_worker
from gateway.admission import Admission, AdmissionConfig
from gateway.app import Gateway
from gateway.auth import Access, ApiKeys
from gateway.breaker import BreakerConfig
from gateway.cli_args import parser
from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.proxy import Proxy
from gateway.raw_send import RawSendConnection
from gateway.ratelimit import RateLimiter
from gateway.response_ids import ResponseIds
from gateway.retry import RetryPolicy
from gateway.shared_response_ids import SharedResponseIds
from gateway.response_store import ResponseStore
from gateway.shared_response_store import SharedResponseStore
from gateway.tokenize import Tokenizers
from gateway.tracing import Tracing, make_exporter
from policies.api import Policy, TierCredits
from policies.registry import load_policy
from workers.drain import DrainingServer
from workers.http_server import client_limits, server_config
from workers.kv.cost_model import CostModel
from workers.listen import listen
from workers.logs import setup_logging
from workers.kv.redis_schema import redact_url
from workers.startup_heap import settle_gc


def build(args: argparse.Namespace) -> Gateway:
    """Wire index, fleet, tokenizers, policy and (optionally) Redis into one ASGI app."""
    if not args.worker and not args.redis:
        raise SystemExit("kvgate gateway: give at least one --worker URL or --redis URL")
    fleet = Fleet(
        ResidencyIndex(),
        interval=args.health_interval,
        timeout=max(0.25, min(1.0, 1.9 - args.health_interval)),
        stall_s=args.engine_stall_s,
        breaker=BreakerConfig(args.breaker_failures, args.breaker_cooldown_s),
        token=args.internal_token,
        kinds={vllm_worker.KIND: vllm_kind(args)},
        tier_credits=TierCredits(args.host_kv_credit, args.disk_kv_credit, args.host_kv_gbps, args.disk_kv_gbps),
    )
    for spec in args.worker:
        add_worker(fleet, spec)
    redis = None
    if args.redis:
        from gateway.redis_state import RedisState

        if not args.internal_token:
            raise SystemExit(
                "kvgate gateway: --redis needs --internal-token (or $KVGATE_INTERNAL_TOKEN): "
                "workers' registrations in Redis are verified with it"
            )
        redis = RedisState(args.redis, fleet, args.internal_token, args.replica_id, interval=args.health_interval)
    policy = build_policy(args.policy, policy_kwargs(args), "kvgate gateway")
    try:
        tracing = Tracing(make_exporter(args.trace, args.trace_endpoint), args.trace_sample_ratio)
    except ValueError as e:
        raise SystemExit(f"kvgate gateway: {e}")
    proxy = Proxy(
        args.upstream_connect_timeout,
        args.upstream_first_byte_timeout,
        args.upstream_idle_timeout,
        args.upstream_answer_timeout,
    )
    admission = Admission(AdmissionConfig(args.max_pending, args.max_queue_per_worker, args.retry_after_s))
    retry = RetryPolicy(args.max_retries, args.retry_backoff_ms / 1000.0)
    try:
        response_ids = ResponseIds(args.response_ids, args.response_ttl_s)
        response_store = store(args, redis is not None)
    except ValueError:
        raise SystemExit(
            "kvgate gateway: --response-ids and --response-store-ids-per-tenant must be at least 1, "
            "--response-ttl-s positive and --response-store-mb and --response-store-mb-per-tenant finite sizes "
            "of at least 1 byte"
        )
    return Gateway(
        fleet,
        Tokenizers(args.block_size, args.model),
        policy,
        proxy=proxy,
        redis=redis,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        pd_wait_ms=args.pd_wait_ms,
        tracing=tracing,
        access=access(args),
        internal_token=args.internal_token,
        max_body_bytes=args.max_body_bytes,
        admission=admission,
        retry=retry,
        access_log=args.access_log,
        fleet_summary_s=args.fleet_summary_s,
        response_ids=response_ids,
        shared_response_ids=SharedResponseIds(args.redis, args.internal_token) if redis is not None else None,
        response_store=response_store,
    )


def store(args: argparse.Namespace, shared: bool) -> ResponseStore:
    """The store of the responses the gateway keeps for kvgate's workers (with Redis, `shared`).
    A tenant's quota is by default a quarter of each bound with API keys (whose tenants share
    the store), all of it without (every response is then one tenant's). Raises ValueError for
    a bound that is not one."""
    keyed = bool(args.api_key or args.api_key_file)
    max_bytes = mb_bytes(args.response_store_mb)
    tenant_size, tenant_bytes = args.response_store_ids_per_tenant, args.response_store_mb_per_tenant
    if tenant_size is None:
        tenant_size = max(1, args.response_ids // 4) if keyed else args.response_ids
    tenant_bytes = (
        mb_bytes(tenant_bytes) if tenant_bytes is not None else max(1, max_bytes // 4) if keyed else max_bytes
    )
    return ResponseStore(
        args.response_ids,
        args.response_ttl_s,
        max_bytes,
        SharedResponseStore(args.redis, args.internal_token, tenant_size, tenant_bytes) if shared else None,
        tenant_size=tenant_size,
        tenant_bytes=tenant_bytes,
    )


def mb_bytes(mb: float) -> int:
    """`mb` MiB as bytes; ValueError unless finite and positive (int() of inf overflows)."""
    if not (math.isfinite(mb) and mb > 0):
        raise ValueError(f"{mb} MiB is not a finite positive size")
    return int(mb * 2**20)


def vllm_kind(args: argparse.Namespace) -> vllm_worker.VllmKind:
    """The vLLM worker kind: hashes at the gateway's block size, the --vllm-profile cost model."""
    profile = None
    if args.vllm_profile:
        try:
            with open(args.vllm_profile) as f:
                profile = json.load(f)
            CostModel.from_json(profile)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise SystemExit(f"kvgate gateway: bad --vllm-profile {args.vllm_profile}: {e}")
    return vllm_worker.VllmKind(args.block_size, profile, needs_cost=args.policy == "slo_goodput")


def add_worker(fleet: Fleet, spec: str) -> None:
    """A `--worker` value: a kvgate worker's URL, or `vllm:URL[?options]`."""
    try:
        vllm = vllm_worker.parse_spec(spec)
    except ValueError as e:
        raise SystemExit(f"kvgate gateway: {e}")
    if vllm is None:
        fleet.add(spec)
    else:
        fleet.add(fleet.kinds[vllm_worker.KIND].add(vllm), kind=vllm_worker.KIND)


def access(args: argparse.Namespace) -> Access:
    """API keys, their rate limits (in Redis when --redis is given) and the cache-header option."""
    for flag in ("rate_limit_rpm", "rate_limit_tpm"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"kvgate gateway: --{flag.replace('_', '-')} must be a positive integer")
    try:
        keys = ApiKeys.load(args.api_key, args.api_key_file, args.rate_limit_rpm, args.rate_limit_tpm)
    except (OSError, ValueError) as e:
        raise SystemExit(f"kvgate gateway: bad API keys: {e}")
    if not keys.enabled and (args.rate_limit_rpm or args.rate_limit_tpm):
        raise SystemExit("kvgate gateway: rate limits are per API key: give --api-key or --api-key-file")
    return Access(keys, RateLimiter(args.redis), args.hide_cache_headers)


def policy_kwargs(args: argparse.Namespace) -> dict:
    """--policy-arg KEY=VALUE pairs (numbers parsed), plus the P/D threshold when given."""
    kwargs = parse_policy_args(args.policy_arg, "kvgate gateway")
    if args.pd_min_uncached_tokens is not None:
        kwargs["pd_min_uncached_tokens"] = args.pd_min_uncached_tokens
    return kwargs


def build_policy(spec: str, kwargs: dict, prog: str, load: Callable[..., Policy] = load_policy) -> Policy:
    """The policy `spec` names, built by `load` with `kwargs`; else one line saying why (an
    unknown name, a plugin that does not load, arguments it does not take) and exit status 2,
    a usage error."""
    try:
        return load(spec, **kwargs)
    except TypeError as e:
        why = f"policy {spec!r} does not take {sorted(kwargs)}: {e}" if kwargs else f"policy {spec!r}: {e}"
    except ValueError as e:
        why = str(e)
    except (ImportError, AttributeError, OSError) as e:
        why = f"cannot load policy {spec!r}: {e}"
    print(f"{prog}: {why}", file=sys.stderr)
    sys.exit(2)


def parse_policy_args(items: list[str], prog: str) -> dict:
    """KEY=VALUE strings -> policy constructor kwargs; values that read as numbers become
    numbers (`kvgate simulate --policy-arg` parses the same way)."""
    kwargs: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{prog}: --policy-arg wants KEY=VALUE, got {item!r}")
        try:
            kwargs[key] = float(value) if "." in value else int(value)
        except ValueError:
            kwargs[key] = value
    return kwargs


def settle_gc_after_startup(app: Starlette) -> None:
    """Run `settle_gc` (workers.startup_heap) once `app`'s lifespan has started, when the default tokenizers are loaded.
    It is done here rather than in the app because it is a decision for the whole process, which
    only the process's entry point may make (tests run several gateways in one process)."""
    startup = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with startup(app) as state:
            settle_gc()
            yield state

    app.router.lifespan_context = lifespan


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sock = listen(args.host, args.port, "kvgate gateway")
    gateway = build(args)
    settle_gc_after_startup(gateway.app)
    print(
        f"kvgate gateway ({gateway.policy.name}) on http://{args.host}:{args.port} "
        f"for {len(args.worker)} static workers{' + redis ' + redact_url(args.redis) if args.redis else ''}",
        flush=True,
    )
    serve(gateway, args, sock)


def serve(gateway: Gateway, args: argparse.Namespace, sock: socket.socket) -> None:
    """Run the gateway under uvicorn on `sock` (httptools on uvloop: a fraction of h11's and
    asyncio's CPU per request) with the client limits and the SIGTERM drain."""
    http_server(gateway, args).run(sockets=[sock])


def http_server(gateway: Gateway, args: argparse.Namespace) -> DrainingServer:
    """The gateway's uvicorn server: the hardened HTTP protocol with its raw body and the client
    limits (a client connection may need an upstream one: two files each), the drain."""
    limits = client_limits(args, files_each=2, retry_after_s=args.retry_after_s)
    config = server_config(gateway.app, limits, args.host, args.port, args.log_level, RawSendConnection)
    return DrainingServer(config, gateway.admission, args.drain_timeout_s)
