"""Real fleets on this machine, each behind a real gateway, driven by `kvgate bench serve`'s
load generator and compared in one report (same JSON and plots as `bench serve`).

    python -m bench.real_fleet --fleet "1p1d=slo_goodput@prefill:1,decode:1" \\
        --fleet "2mixed=slo_goodput@mixed:2" --gateway-arg=--pd-min-uncached-tokens=256 \\
        --workload mixed --sweep 0.1,0.2,0.4 --duration 60 --slo-ttft-ms 8000 --slo-tpot-ms 300 \\
        --out bench/results/serve-pd-cpu.json

A fleet is `LABEL=POLICY@ROLE:COUNT,...`. For each, in turn: its workers start
(`kvgate worker --model M --executor E --role ROLE`, one CPU thread each, a shared internal
token so P/D transfers are allowed), then a gateway with that policy; every rate of the sweep
runs against the gateway; then all of it stops, so fleets never share the machine. Before each
rate every worker's prefix cache is emptied (`POST /kv/reset`, with the internal token): the
workloads are seeded, so each rate sends the same documents and prefixes, and a cache warmed
by the previous rate would turn its long prefills into hits.
"""

import argparse
import os
import secrets
import sys
import time

from bench import report as rep
from bench.loadgen import run_loop, run_rate
from bench.workloads import add_args, from_args
from gateway.procs import Worker, start_gateway, stop_all


def parse_fleet(spec: str) -> tuple[str, str, list[str]]:
    """`LABEL=POLICY@ROLE:COUNT,...` -> (label, policy, one role per worker)."""
    label, sep, rest = spec.partition("=")
    policy, sep2, roles = rest.partition("@")
    if not (sep and sep2 and label and policy):
        raise ValueError(f"--fleet wants LABEL=POLICY@ROLE:COUNT,..., got {spec!r}")
    out = []
    for part in roles.split(","):
        role, _, count = part.partition(":")
        if role not in ("mixed", "prefill", "decode") or not count.isdigit():
            raise ValueError(f"bad role count {part!r} in --fleet {spec!r}")
        out += [role] * int(count)
    return label, policy, out


def start_fleet(label: str, policy: str, roles: list[str], args: argparse.Namespace, token: str) -> list:
    """Workers and their gateway, ready; the gateway is last in the list."""
    extra = ["--internal-token", token, *args.worker_arg]
    workers = [
        Worker(
            args.executor,
            f"{label}-{role[0]}{i}",
            model=args.model,
            log_dir=args.log_dir,
            extra=["--role", role, *extra],
        )
        for i, role in enumerate(roles)
    ]
    procs = list(workers)
    try:
        for w in workers:
            w.ready(600)
        gateway = start_gateway(
            [w.url for w in workers],
            policy,
            name=f"gateway-{label}",
            log_dir=args.log_dir,
            extra=[
                "--internal-token",
                token,
                "--slo-ttft-ms",
                str(args.slo_ttft_ms),
                "--slo-tpot-ms",
                str(args.slo_tpot_ms),
                *args.gateway_arg,
            ],
        )
        procs.append(gateway)
        gateway.wait_ready(timeout=120)
        gateway.wait_healthy(len(workers), timeout=30, what=f"the gateway to see {len(workers)} healthy workers")
    except BaseException:
        stop_all(procs)
        raise
    return procs


def run_fleet(spec: str, args: argparse.Namespace, rates: list[float]) -> tuple[str, list[dict]]:
    label, policy, roles = parse_fleet(spec)
    print(f"fleet {label}: {policy} over {', '.join(roles)}", file=sys.stderr, flush=True)
    token = secrets.token_hex(16)
    procs = start_fleet(label, policy, roles, args, token)
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    runs = []
    try:
        for rate in rates:
            for w in procs[:-1]:
                w.reset_cache()
            records = run_loop(run_rate([procs[-1].url], from_args(args, rate), args.model, slo, timeout=args.timeout))
            run = rep.summarize(records, *slo)
            run.update(
                rate_rps=rate, records=records, pd_requests=sum(r.get("prefill_worker") is not None for r in records)
            )
            runs.append(run)
            print(
                f"  {label} {rate:g} req/s: attainment {run['slo_attainment']:.3f}, "
                f"ttft p50 {run['ttft_p50_ms'] or 0:.0f} ms, tpot p50 {run['tpot_p50_ms'] or 0:.1f} ms, "
                f"P/D {run['pd_requests']}, errors {run['errors']}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        stop_all(procs)
    return label, runs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.real_fleet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--fleet", action="append", required=True, metavar="LABEL=POLICY@ROLE:COUNT,...")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--executor", choices=["torch", "sim"], default="torch")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag (repeatable)")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag (repeatable)")
    p.add_argument("--sweep", required=True, help="R1,R2,...: request rates, run in this order per fleet")
    add_args(p)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--log-dir", help="where worker and gateway logs go (default: a temp dir per process)")
    p.add_argument("--title", help="plot title")
    p.add_argument("--out", required=True, help="report JSON; plots are written next to it")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rates = [float(r) for r in args.sweep.split(",")]
    t0 = time.perf_counter()
    try:
        series = dict(run_fleet(spec, args, rates) for spec in args.fleet)
    except ValueError as e:
        raise SystemExit(f"bench.real_fleet: {e}")
    meta = {
        "kind": "bench-real-fleet",
        "title": args.title or f"{args.workload}: " + " vs ".join(series),
        "command": "python -m bench.real_fleet " + " ".join(argv),
        "fleets": args.fleet,
        "model": args.model,
        "executor": args.executor,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "gateway_args": args.gateway_arg,
        "worker_args": args.worker_arg,
        "workload": {k: v for k, v in vars(from_args(args, 0.0)).items() if k != "rate"},
        "wall_s": time.perf_counter() - t0,
    }
    rep.publish(series, meta, args.out)


if __name__ == "__main__":
    main()
