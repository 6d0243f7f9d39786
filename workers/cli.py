"""`kvgate worker`: serve one model from a paged KV cache over the OpenAI API."""

import argparse
import json
import logging
import os
import socket
import uuid
from pathlib import Path

from starlette.types import ASGIApp

from workers.cli_help import HelpFormatter
from workers.drain import DrainingServer, Drainable
from workers.config import EngineConfig
from workers.engine import Engine
from workers.generation_defaults import (
    NEUTRAL,
    GenerationDefaults,
    eos_token_ids,
    load_generation_defaults,
    read_generation_config,
)
from workers.http_server import add_client_args, client_limits, server_config
from workers.startup_heap import settle_gc
from workers.kv.cost_model import CostModel
from workers.kv.read_back import DISK_GBPS, HOST_GBPS
from workers.listen import listen
from workers.logs import add_log_args, setup_logging
from workers.model_store import load_tokenizer, resolve, served_name
from workers.server import RETRY_AFTER_S, WorkerServer
from workers.telemetry import add_trace_args, provider_from_args
from workers.tracing import WorkerTracing

log = logging.getLogger("kvgate.worker")
# the worker's remarks on the client limits it shares with the gateway: where they meet the fleet's traffic
CLIENT_NOTES = {
    "--max-connections": "the gateways' connections count too: one for each request in flight, KV-event stream and poll",
    "--client-body-min-rate": "a decode worker's /kv/import bodies (P/D over HTTP) too: lower it (not "
    "the body timeout) for exports over slower links, raise --client-body-max-timeout for longer ones",
    "--client-idle-timeout": "keep it above 4 s, how long a gateway reuses an idle connection",
    "--client-send-timeout": "keep it at least the gateway's: a gateway's client that reads slowly "
    "slows the gateway's reads here",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate worker", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="HF model folder or alias (smollm2-135m)")
    p.add_argument("--served-model-name", help="name clients use (default: alias or folder name)")
    p.add_argument(
        "--executor",
        choices=["torch", "sim"],
        default="torch",
        help="torch runs the model; sim runs no model and takes the cost model's step times "
        "(fleets on a laptop, the simulator)",
    )
    p.add_argument(
        "--sim-profile",
        help="cost-model JSON: the sim executor's step times, and for any executor "
        "the model the gateway predicts this worker by (kvgate calibrate writes one)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8100, help="port to listen on")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the gateway's --block-size)")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks in the pool")
    p.add_argument(
        "--kv-cache-gb", type=float, help="size the KV pool by memory instead of --num-blocks (torch executor)"
    )
    p.add_argument(
        "--host-kv-gb",
        type=float,
        default=0.0,
        help="host memory for KV blocks evicted from the device (pinned on CUDA); a later prefix "
        "hit copies them back instead of recomputing them (default 0: off)",
    )
    p.add_argument(
        "--disk-kv-gb",
        type=float,
        default=0.0,
        help="disk space for KV blocks under the host tier (needs --host-kv-gb and --disk-kv-dir): "
        "every block stored in host memory is also written to a file, LRU within this bound, and a "
        "later prefix hit reads it back off the engine thread (default 0: off)",
    )
    p.add_argument(
        "--disk-kv-dir",
        help="directory for the disk tier's files: each run writes a directory of its own there, "
        "removed at shutdown; an earlier run's of the same --worker-id is removed at start",
    )
    p.add_argument(
        "--host-kv-gbps",
        type=float,
        default=HOST_GBPS,
        help="host -> device copy rate in GB/s: with a cost model (--sim-profile, or the sim "
        "executor's) a prefix hit in the host or disk tier is copied back only as far as that "
        "is faster than recomputing it; published in /state, where the gateway reads it to predict "
        "the same choice",
    )
    p.add_argument(
        "--disk-kv-gbps",
        type=float,
        default=DISK_GBPS,
        help="file -> device read rate in GB/s, for the same choice (published in /state, as --host-kv-gbps)",
    )
    p.add_argument(
        "--kv-load-every-hit",
        action="store_true",
        help="copy back every host and disk hit, even where recomputing it would be faster",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=2048,
        help="tokens one engine step computes at most (prefill is chunked to fit)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests in the running batch at most")
    p.add_argument("--max-model-len", type=int, help="cap the context length below the model's")
    p.add_argument(
        "--generation-config",
        default="auto",
        help="the sampling defaults a request's absent fields take, as vLLM's flag: auto (the model "
        "folder's generation_config.json), vllm (none: OpenAI's), or a folder holding a "
        "generation_config.json (whose max_new_tokens then caps every request's budget)",
    )
    p.add_argument(
        "--override-generation-config",
        help="a JSON object of generation-config fields set over it, e.g. '{\"temperature\": 0.5}' "
        "(a max_new_tokens here caps every request's budget)",
    )
    p.add_argument(
        "--role",
        choices=["mixed", "prefill", "decode"],
        default="mixed",
        help="P/D disaggregation: prefill workers export KV to decode workers; mixed does both",
    )
    p.add_argument("--worker-id", help="stable id in KV events and the registry (default: random)")
    p.add_argument("--device", default="cpu", help="torch device of the torch executor (cpu, cuda, cuda:1)")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 on GPU"
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="never reuse cached prompt blocks (every prompt is computed whole)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs for decode steps (torch executor on CUDA; default: graphs on)",
    )
    p.add_argument(
        "--internal-token",
        default=os.environ.get("KVGATE_INTERNAL_TOKEN"),
        help="the fleet's shared secret for internal calls: /kv/import, /kv/reset, a body's "
        "kv_transfer (default: $KVGATE_INTERNAL_TOKEN); none refuses them all; "
        "required for --role prefill|decode",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests held beyond the running batch (--max-num-seqs); more get 503 + Retry-After",
    )
    p.add_argument(
        "--stall-timeout-s",
        type=float,
        default=5.0,
        help="/health answers 503 when the engine has work but no step completed for this long",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long in-flight requests may take to finish before the worker exits",
    )
    add_client_args(p.add_argument_group("client connections"), CLIENT_NOTES)
    p.add_argument(
        "--kv-transport",
        choices=["http", "ipc", "nixl"],
        default="http",
        help="P/D export: bytes over HTTP, CUDA IPC handles between GPUs of one host, or NIXL "
        "(UCX) writes into the decode worker's cache, any host (pip install 'kvgate[nixl]'); "
        "both fall back to HTTP",
    )
    p.add_argument(
        "--nixl-quarantine-s",
        type=float,
        default=None,
        help="NIXL decode side: how long blocks that a failed or expired WRITE may still land in "
        "stay out of the pool before they are reused (default: the reservation's lifetime, "
        "5 s plus its bytes at 0.2 GB/s)",
    )
    p.add_argument(
        "--kv-export-batch-blocks",
        type=int,
        default=16,
        help="P/D prefill side: ship a prompt's blocks while it still prefills, in batches of at "
        "least this many new blocks, so their transfer overlaps the rest of the prefill; "
        "0 ships them all when the prefill ends",
    )
    p.add_argument(
        "--redis",
        metavar="URL",
        default=os.environ.get("KVGATE_REDIS_URL"),
        help="publish KV events, residency and signed heartbeats to this Redis URL "
        "(redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS; default: $KVGATE_REDIS_URL); "
        "needs --internal-token",
    )
    p.add_argument("--advertise-url", help="URL the gateway should use (default: http://HOST:PORT)")
    add_trace_args(p)
    add_log_args(p)
    return p


def model_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    return json.loads(cfg_file.read_text()) if cfg_file.exists() else {}


def build_executor(args, path: Path, tokenizer, eos: tuple[int, ...]):
    """The torch model runner, or the sim executor with the model's vocabulary; both stop on `eos`."""
    if args.executor == "torch":
        import torch

        from workers.executors.torch_runner import TorchRunner, blocks_that_fit
        from workers.models.loader import default_dtype

        dtype = getattr(torch, args.dtype) if args.dtype else None
        if args.kv_cache_gb:
            args.num_blocks = blocks_that_fit(
                str(path),
                int(args.kv_cache_gb * 2**30),
                args.block_size,
                dtype or default_dtype(torch.device(args.device)),
            )
        runner = TorchRunner(
            str(path),
            args.num_blocks,
            args.block_size,
            args.device,
            dtype,
            enforce_eager=args.enforce_eager,
            max_num_seqs=args.max_num_seqs,
            eos_ids=eos,
        )
    else:
        from workers.executors.sim import SimExecutor

        cfg = model_config(path)
        cost = CostModel.load(args.sim_profile) if args.sim_profile else CostModel()
        runner = SimExecutor(
            cost,
            cfg.get("vocab_size", len(tokenizer)),
            eos,
            cfg.get("max_position_embeddings", 8192),
        )
    if args.max_model_len:
        runner.max_model_len = min(runner.max_model_len, args.max_model_len)
    return runner


def check_args(args: argparse.Namespace) -> None:
    """Refuse settings that would fail on every request later."""
    if args.role != "mixed" and not args.internal_token:
        raise SystemExit(
            f"kvgate worker: --role {args.role} needs the fleet's internal token "
            "(--internal-token or $KVGATE_INTERNAL_TOKEN): P/D legs and KV imports "
            "are refused without it"
        )
    if args.redis and not args.internal_token:
        raise SystemExit(
            "kvgate worker: --redis needs --internal-token (or $KVGATE_INTERNAL_TOKEN): "
            "registrations in Redis are signed with it"
        )
    if args.host_kv_gb < 0 or args.disk_kv_gb < 0:
        raise SystemExit("kvgate worker: --host-kv-gb and --disk-kv-gb must be >= 0")
    if args.host_kv_gbps <= 0 or args.disk_kv_gbps <= 0:
        raise SystemExit("kvgate worker: --host-kv-gbps and --disk-kv-gbps must be > 0")
    if args.disk_kv_gb > 0 and not (args.host_kv_gb > 0 and args.disk_kv_dir):
        raise SystemExit("kvgate worker: --disk-kv-gb needs --host-kv-gb (it is written through it) and --disk-kv-dir")
    if args.kv_export_batch_blocks < 0:
        raise SystemExit("kvgate worker: --kv-export-batch-blocks must be >= 0")
    if args.nixl_quarantine_s is not None and args.nixl_quarantine_s <= 0:
        raise SystemExit("kvgate worker: --nixl-quarantine-s must be > 0")
    if args.max_queued_requests < 0 or args.stall_timeout_s <= 0 or args.drain_timeout_s < 0:
        raise SystemExit(
            "kvgate worker: --max-queued-requests and --drain-timeout-s must be >= 0, --stall-timeout-s > 0"
        )


def tier_blocks(gb: float, block_size: int, kv_bytes_per_token: int) -> int:
    """How many blocks `gb` GiB of a tier (host memory, disk) holds (0 when off or the blocks carry no bytes)."""
    if gb <= 0 or kv_bytes_per_token <= 0:
        return 0
    return int(gb * 2**30) // (block_size * kv_bytes_per_token)


def build_server(args) -> WorkerServer:
    path = resolve(args.model, tokenizer_only=args.executor == "sim")
    tokenizer = load_tokenizer(args.model)
    defaults, eos = generation_config(args, path, tokenizer.eos_token_id)
    executor = build_executor(args, path, tokenizer, eos)
    name = args.served_model_name or served_name(args.model)
    config = EngineConfig(
        model_id=name,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        worker_id=args.worker_id or f"w-{uuid.uuid4().hex[:8]}",
        role=args.role,
        enable_prefix_caching=not args.no_prefix_caching,
        export_batch_blocks=args.kv_export_batch_blocks,
        host_blocks=tier_blocks(args.host_kv_gb, args.block_size, getattr(executor, "kv_bytes_per_token", 0)),
        disk_blocks=tier_blocks(args.disk_kv_gb, args.block_size, getattr(executor, "kv_bytes_per_token", 0)),
        disk_dir=args.disk_kv_dir or "",
        host_gbps=args.host_kv_gbps,
        disk_gbps=args.disk_kv_gbps,
        load_every_hit=args.kv_load_every_hit,
        cost_model=CostModel.load(args.sim_profile) if args.sim_profile else getattr(executor, "cost", None),
        generation_defaults=defaults,
    )
    try:
        tracing = WorkerTracing(provider_from_args(args, "kvgate-worker"), config.worker_id, name)
    except ValueError as e:
        raise SystemExit(f"kvgate worker: {e}")
    engine = Engine(executor, tokenizer, config)
    engine.start()
    return WorkerServer(
        engine,
        name,
        getattr(executor, "vocab_size", len(tokenizer)),
        args.internal_token,
        args.kv_transport,
        args.max_queued_requests,
        args.stall_timeout_s,
        tracing,
        args.nixl_quarantine_s,
    )


def generation_config(
    args: argparse.Namespace, path: Path, tokenizer_eos: int | None
) -> tuple[GenerationDefaults, tuple[int, ...]]:
    """The model's sampling defaults and the ids that end a generation, read once (a file that is
    not a generation config stops the worker here); the defaults said where they change what a
    request that leaves a field out gets (vLLM warns of the same)."""
    try:
        defaults = load_generation_defaults(path, args.generation_config, args.override_generation_config)
        eos = eos_token_ids(read_generation_config(path, args.generation_config), tokenizer_eos)
    except ValueError as e:
        raise SystemExit(f"kvgate worker: {e}")
    if defaults != NEUTRAL:
        log.info(
            "sampling defaults from the generation config (%s): %s; --generation-config vllm serves OpenAI's",
            args.generation_config,
            json.dumps(defaults.to_json()),
        )
    return defaults, eos


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    check_args(args)
    setup_logging(args.log_level, args.log_format)
    sock = listen(args.host, args.port, "kvgate worker")
    serve(args, build_server(args), sock)


def serve(args: argparse.Namespace, server: WorkerServer, sock: socket.socket | None = None) -> None:
    """Publish to Redis if asked (and look NIXL peers' layouts up there), then serve on `sock` (else a socket taken now) until SIGTERM
    has drained the worker."""
    sock = sock or listen(args.host, args.port, "kvgate worker")
    if args.redis:
        from workers.redis_publisher import RedisPublisher

        nixl = server.transfer.nixl
        if nixl is not None:
            nixl.peers.use_redis(args.redis, server.model)
        server.publisher = RedisPublisher(
            server.engine,
            args.redis,
            args.advertise_url or f"http://{args.host}:{args.port}",
            server.model,
            args.internal_token,
            lambda: {**server.engine.state().to_json(), "kv_transfer": server.transfer.stats()},
            agent=nixl.record(server.engine.worker_id) if nixl is not None else None,
        )
    print(
        f"kvgate worker {server.engine.worker_id} serving {server.model} "
        f"({args.executor}, role={args.role}) on http://{args.host}:{args.port}",
        flush=True,
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settle_gc()
    http_server(args, server.app, server).run(sockets=[sock])


def http_server(args: argparse.Namespace, app: ASGIApp, worker: Drainable) -> DrainingServer:
    """The worker's uvicorn server: the hardened HTTP protocol the gateway's runs too, with the
    client limits (one file a connection), and the drain of `worker`. A client that reaches a
    worker directly must not hold its connections with a trickling head, an unread answer or
    idle sockets."""
    limits = client_limits(args, files_each=1, retry_after_s=RETRY_AFTER_S)
    config = server_config(app, limits, args.host, args.port, args.log_level, access_log=True)
    return DrainingServer(config, worker, args.drain_timeout_s)
