"""`python -m bench.chaos`: the gateway and its workers under faults and overload, on this
machine (real processes on loopback, sim workers), judged request by request.

    python -m bench.chaos --scenarios soak,redis,overload --requests 10000 \\
        --out bench/results/chaos.json

Scenarios:
- `soak`: a closed loop of `--requests` requests (half streamed) while a random worker is
  SIGKILLed every `--kill-every` seconds and restarted on its port. Every request must end
  `ok` or as a clean error (`bench.chaos_client` says what counts); afterwards no worker holds
  a KV block, and the gateway's RSS stays flat.
- `redis`: the same load on a Redis-discovered fleet while redis-server is SIGKILLed and
  restarted on its port.
- `overload`: the fleet's capacity is measured (closed loop, every slot busy), then Poisson
  arrivals at `--overload-factor` times it hit a gateway with default admission control and one
  without (unbounded queues): outcomes, and p50/p99 of the admitted requests' latency.
- `liveness`: seconds from a fault to the gateway taking the worker out of its candidates:
  engine thread frozen or dead behind a live server (`bench.fault_worker`), process
  SIGSTOPped or SIGKILLed.

Writes the JSON report and, next to it, a PNG timeline per scenario (outcomes per second,
kills marked, gateway RSS). The fleet and its probes: bench/chaos_fleet.py; the summary,
headline and plot: bench/chaos_report.py.
"""

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from bench import chaos_client as cc
from bench.chaos_fleet import Fleet, Sampler, healthy, leaks, rss_mb, start_fleet
from bench.chaos_report import headline, plot, rss_growth, summary
from gateway.procs import (
    TEST_TOKEN,
    Proc,
    free_port,
    start_gateway,
    start_redis,
    stop_all,
    wait_for,
    wait_redis,
)
from workers.internal_auth import internal_headers

UNBOUNDED = ["--max-queue-per-worker", "1000000", "--max-pending", "1000000"]


def worker_extra(args: argparse.Namespace, profile: dict | None = None) -> list[str]:
    extra = list(args.worker_arg)
    if profile:
        path = Path(args.log_dir) / f"profile-{abs(hash(json.dumps(profile, sort_keys=True)))}.json"
        path.write_text(json.dumps(profile))
        extra += ["--sim-profile", str(path)]
    return extra


def drive(fleet: Fleet, args: argparse.Namespace, chaos) -> dict:
    """The closed-loop load against `fleet` while `chaos(t0, stop)` runs in a thread; the
    run's summary, what is left behind on the fleet, and the gateway's RSS."""
    stop = threading.Event()
    t0 = time.monotonic()
    rss = Sampler(lambda: rss_mb(fleet.gateway.popen.pid), t0)
    thread = threading.Thread(target=chaos, args=(t0, stop), daemon=True)
    rss.start()
    thread.start()
    try:
        outcomes = asyncio.run(
            cc.closed_loop(fleet.gateway.url, args.requests, args.concurrency, cc.Shape(), args.seed, t0, args.timeout)
        )
        span = time.monotonic() - t0
    finally:
        stop.set()
        thread.join()
        samples = rss.stop()
    wait_for(lambda: healthy(fleet.gateway) == len(fleet.workers), timeout=30, what="every worker back")
    result = summary(outcomes, span)
    result.update(leaks(fleet))
    result.update(rss_growth(samples, span), rss_mb=samples, events=fleet.events)
    return result


def run_soak(args: argparse.Namespace) -> dict:
    """Random worker SIGKILLs and restarts under a closed loop of requests."""
    fleet = start_fleet(args, args.log_dir, worker_extra(args))

    def chaos(t0: float, stop: threading.Event) -> None:
        rng = random.Random(args.seed)
        while not stop.wait(rng.uniform(*args.kill_every)):
            i = rng.randrange(len(fleet.workers))
            fleet.workers[i].kill()
            fleet.events.append((time.monotonic() - t0, "kill", f"w{i}"))
            stop.wait(args.restart_after)
            fleet.restart(i)
            fleet.events.append((time.monotonic() - t0, "restart", f"w{i}"))

    try:
        return drive(fleet, args, chaos)
    finally:
        stop_all(fleet.procs())


def run_redis(args: argparse.Namespace) -> dict:
    """redis-server SIGKILLed `--redis-kill-at` s into a run on a Redis-discovered fleet and
    restarted on its port `--redis-down-s` later."""
    servers = [wait_redis(start_redis(log_dir=args.log_dir))]
    port = servers[0].port
    try:
        fleet = start_fleet(args, args.log_dir, worker_extra(args), f"redis://127.0.0.1:{port}")
    except BaseException:
        stop_all(servers)
        raise

    def chaos(t0: float, stop: threading.Event) -> None:
        if stop.wait(args.redis_kill_at):
            return
        servers[-1].kill()
        fleet.events.append((time.monotonic() - t0, "kill", "redis"))
        stop.wait(args.redis_down_s)
        servers.append(wait_redis(start_redis(port, log_dir=args.log_dir)))
        fleet.events.append((time.monotonic() - t0, "restart", "redis"))

    try:
        return drive(fleet, args, chaos)
    finally:
        stop_all(fleet.procs() + servers)


def run_overload(args: argparse.Namespace) -> dict:
    """Capacity, then `--overload-factor` times it against admission control and without."""
    profile = {"base_ms": args.overload_step_ms}
    extra = worker_extra(args, profile) + ["--max-num-seqs", str(args.overload_seqs)]
    shape = cc.Shape(output=(args.overload_tokens, args.overload_tokens))
    out: dict = {
        "workers": args.workers,
        "max_num_seqs": args.overload_seqs,
        "step_ms": args.overload_step_ms,
        "output_tokens": args.overload_tokens,
        "factor": args.overload_factor,
    }
    fleet = start_fleet(args, args.log_dir, extra)
    try:
        t0 = time.monotonic()
        slots = args.workers * args.overload_seqs
        cal = asyncio.run(
            cc.closed_loop(fleet.gateway.url, slots * args.calibrate_rounds, slots, shape, args.seed, t0, args.timeout)
        )
        capacity = cc.counts(cal)[cc.OK] / (time.monotonic() - t0)
        out["capacity_rps"] = capacity
        stop_all([fleet.gateway])
        for label, gateway_extra in (("admission", []), ("unbounded", UNBOUNDED)):
            if label not in args.overload_variants:
                continue
            fleet.gateway = start_gateway(
                [w.url for w in fleet.workers],
                args.policy,
                log_dir=args.log_dir,
                name=f"gateway-{label}",
                extra=[*args.gateway_arg, *gateway_extra],
            )
            fleet.gateway.wait_ready("/v1/models", timeout=120)
            wait_for(lambda: healthy(fleet.gateway) == args.workers, timeout=30, what="every worker healthy")
            out[label] = overload_once(fleet, args, capacity * args.overload_factor, shape)
            stop_all([fleet.gateway])
            fleet.gateway = None
        return out
    finally:
        stop_all(fleet.procs())


def overload_once(fleet: Fleet, args: argparse.Namespace, rate: float, shape: cc.Shape) -> dict:
    t0 = time.monotonic()
    waiting = Sampler(
        lambda: max(
            httpx.get(w.url + "/state", timeout=2, headers=internal_headers(TEST_TOKEN)).json()["waiting"]
            for w in fleet.workers
        ),
        t0,
        0.2,
    )
    waiting.start()
    try:
        outcomes = asyncio.run(
            cc.open_loop(fleet.gateway.url, rate, args.overload_s, shape, args.seed, t0, args.timeout)
        )
    finally:
        samples = waiting.stop()
    result = summary(outcomes, time.monotonic() - t0)
    result.update(rate_rps=rate, max_worker_waiting=max((v for _, v in samples), default=0), worker_waiting=samples)
    return result


def fault_worker(name: str, logs: str) -> Proc:
    """A real worker whose engine freezes or dies on a marked prompt (`bench.fault_worker`)."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "bench.fault_worker",
        "--model",
        cc.MODEL,
        "--executor",
        "sim",
        "--port",
        str(port),
        "--worker-id",
        name,
    ]
    return Proc(name, argv, port, logs).wait_ready(timeout=120)


def run_liveness(args: argparse.Namespace) -> dict:
    """Seconds from a fault to the gateway taking the worker out of its candidates, per fault:
    the engine thread frozen or dead behind a live HTTP server, the process stopped or killed."""
    from bench import fault_worker as fw

    logs = args.log_dir
    out: dict = {}
    for fault in ("engine_frozen", "engine_dead", "sigstop", "sigkill"):
        times = []
        for trial in range(args.liveness_trials):
            w = fault_worker(f"{fault}-{trial}", logs)
            gw = start_gateway(
                [w.url], args.policy, name=f"gateway-{fault}-{trial}", log_dir=logs, extra=list(args.gateway_arg)
            )
            try:
                gw.wait_ready("/v1/models", timeout=120)
                wait_for(lambda: healthy(gw) == 1, timeout=30, what="the worker healthy")
                marker = {"engine_frozen": fw.FREEZE, "engine_dead": fw.DIE}.get(fault)
                t0 = time.monotonic()
                if marker is not None:
                    threading.Thread(target=lambda: _quietly(w.url, marker), daemon=True).start()
                else:
                    w.signal(signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
                wait_for(lambda: healthy(gw) == 0, timeout=30, interval=0.01, what=f"{fault} detected")
                times.append(time.monotonic() - t0)
            finally:
                w.signal(signal.SIGCONT)
                stop_all([gw, w])
        out[fault] = {"seconds": times, "max_s": max(times), "mean_s": sum(times) / len(times)}
    return out


def _quietly(url: str, marker: int) -> None:
    try:
        httpx.post(
            url + "/v1/completions", timeout=30, json={"model": cc.MODEL, "prompt": [marker, 1], "max_tokens": 1}
        )
    except httpx.HTTPError:
        pass


SCENARIOS = {"soak": run_soak, "redis": run_redis, "overload": run_overload, "liveness": run_liveness}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--scenarios", default="soak,redis,overload,liveness", help="comma-separated: soak, redis, overload, liveness"
    )
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--policy", default="prefix_affinity")
    p.add_argument("--requests", type=int, default=2000, help="soak and redis: requests sent")
    p.add_argument("--concurrency", type=int, default=16, help="soak and redis: requests in flight")
    p.add_argument(
        "--kill-every",
        type=float,
        nargs=2,
        default=(2.0, 4.0),
        metavar=("MIN", "MAX"),
        help="soak: seconds between worker SIGKILLs, uniform in [MIN, MAX]",
    )
    p.add_argument("--restart-after", type=float, default=0.5, help="soak: seconds a killed worker stays down")
    p.add_argument("--redis-kill-at", type=float, default=3.0)
    p.add_argument("--redis-down-s", type=float, default=2.0)
    p.add_argument("--overload-factor", type=float, default=5.0)
    p.add_argument("--overload-s", type=float, default=20.0, help="overload: seconds of arrivals")
    p.add_argument("--overload-seqs", type=int, default=4, help="overload: each worker's --max-num-seqs")
    p.add_argument("--overload-step-ms", type=float, default=20.0, help="overload: sim step time floor")
    p.add_argument("--overload-tokens", type=int, default=20, help="overload: output tokens per request")
    p.add_argument("--overload-variants", default="admission,unbounded")
    p.add_argument("--calibrate-rounds", type=int, default=6, help="overload: capacity run, requests per slot")
    p.add_argument("--liveness-trials", type=int, default=3, help="liveness: trials per fault")
    p.add_argument("--timeout", type=float, default=120.0, help="client timeout per request (then: lost)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag (repeatable)")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag (repeatable)")
    p.add_argument("--log-dir", help="process logs (default: a temp dir)")
    p.add_argument("--out", required=True, help="report JSON; the timeline PNG is written next to it")
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.log_dir is None:
        import tempfile

        args.log_dir = tempfile.mkdtemp(prefix="kvgate-chaos-")
    os.makedirs(args.log_dir, exist_ok=True)
    names = [s for s in args.scenarios.split(",") if s]
    if unknown := set(names) - set(SCENARIOS):
        raise SystemExit(f"bench.chaos: unknown scenarios {sorted(unknown)}")
    report = {"kind": "chaos", "command": "python -m bench.chaos " + " ".join(argv), "scenarios": {}}
    for name in names:
        print(f"chaos: {name} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        report["scenarios"][name] = run = SCENARIOS[name](args)
        report["scenarios"][name]["wall_s"] = time.monotonic() - t0
        print(f"chaos: {name}: {headline(run)}", file=sys.stderr, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report, str(Path(args.out).with_suffix(".png")))
    return report


if __name__ == "__main__":
    main()
