"""`kvgate simulate`: compare routing policies on a simulated fleet, in virtual time.

    kvgate simulate --workers 128 --policies round_robin,prefix_affinity --workload shared-prefix \\
        --sweep --duration 60 --slo-ttft-ms 1000 --slo-tpot-ms 50 \\
        --profile bench/profiles/h200-llama8b.json --out bench/results/sim.json

Each (policy, rate) is one independent simulation of a fresh fleet (see fleet_sim). `--rate R`
runs one rate; `--sweep R1,R2,...` runs those; a bare `--sweep` searches each policy's goodput:
it doubles the rate from a conservative guess until attainment drops below 90%, then bisects
`--refine` times, and finally runs every policy at the best policy's highest passing rate so
the headline numbers compare like with like. `--policy-arg KEY=VALUE` passes constructor
arguments to the policies that take them (e.g. slo_goodput's pd_min_uncached_tokens). Output:
the JSON report plus -cdf.png and -attainment.png next to it.
"""

import argparse
import inspect
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

from bench import report as rep
from bench.fleet_sim import FleetConfig, FleetSim, stderr_progress
from bench.transfer_model import DEFAULT_PROFILE, TransferLink
from bench.transfer_model import load as load_link
from bench.sim_worker import SimConfig
from bench.workloads import WorkloadConfig, add_args, from_args, generate, resolve_rates
from gateway.server import build_policy, parse_policy_args
from policies.api import DEFAULT_TIER_CREDITS, TierCredits
from policies.registry import BUILTIN_POLICIES, load_policy
from workers.cli_help import HelpFormatter
from workers.kv.cost_model import CostModel

MAX_DOUBLINGS = 14


def run_one(
    policy: str, kwargs: dict, rate: float, wl: WorkloadConfig, fleet: FleetConfig, quiet: bool = False
) -> dict:
    """One simulation: a fresh fleet behind `policy` (built with `kwargs`) at `rate`; returns
    its summary."""
    label = f"{policy} @ {rate:g} req/s"
    sim = FleetSim(load_policy(policy, **kwargs), fleet)
    t0 = time.perf_counter()
    records = sim.run(generate(wl.with_rate(rate)), wl.duration_s, None if quiet else stderr_progress(label))
    wall = time.perf_counter() - t0
    out = rep.summarize(records, fleet.slo_ttft_ms, fleet.slo_tpot_ms)
    out.update(rate_rps=rate, wall_s=wall, events=sim.events_processed)
    if fleet.roles:
        out.update(pd_routed=sim.pd_routed, pd_kv_arrived=sim.pd_arrived, pd_fallbacks=sim.pd_fallbacks)
        pd = [r["ttft_ms"] for r in records if r["prefill_worker"] is not None and r["error"] is None]
        out.update(rep.percentiles(pd, "pd_ttft"))  # the disaggregated requests alone
    if not quiet:
        print(
            f"  {label}: {rep.run_line(out)}; {out['requests']} requests in {wall:.1f} s wall",
            file=sys.stderr,
            flush=True,
        )
    return out


def start_rate(wl: WorkloadConfig, fleet: FleetConfig) -> float:
    """A rate the fleet surely sustains: every worker serving one uncached request at a time."""
    sample = [r for _, r in zip(range(200), generate(wl.with_rate(max(wl.rate, 1.0))))]
    if not sample:
        return 1.0
    prompt = sum(len(r.prompt) for r in sample) / len(sample)
    out = sum(r.max_tokens for r in sample) / len(sample)
    c = fleet.cost
    ms = c.prefill_ms(int(prompt), chunk=fleet.sim.max_batched_tokens) + out * c.decode_ms(1, int(prompt + out / 2))
    return _round(fleet.workers * 1000.0 / ms)


def _round(r: float) -> float:
    return float(f"{r:.3g}")


def search(policy: str, kwargs: dict, wl: WorkloadConfig, fleet: FleetConfig, start: float, refine: int) -> list[dict]:
    """Attainment at the rates needed to bracket the 90% crossing, then `refine` bisections."""
    runs: dict[float, dict] = {}

    def passes(r: float) -> bool:
        if r not in runs:
            runs[r] = run_one(policy, kwargs, r, wl, fleet)
        return runs[r]["slo_attainment"] >= rep.TARGET

    r = start
    if passes(r):
        for _ in range(MAX_DOUBLINGS):
            if not passes(_round(r * 2)):
                break
            r = _round(r * 2)
        lo, hi = r, _round(r * 2)
    else:
        for _ in range(MAX_DOUBLINGS):
            if passes(_round(r / 2)):
                break
            r = _round(r / 2)
        lo, hi = _round(r / 2), r
    for _ in range(refine):
        mid = _round((lo + hi) / 2)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return list(runs.values())


def sweep(
    policies: dict[str, dict], rates: list[float] | None, wl: WorkloadConfig, fleet: FleetConfig, refine: int, jobs: int
) -> dict[str, list[dict]]:
    """Runs per policy (name -> constructor kwargs): the given rates, or a goodput search plus
    the common reference rate."""
    with ProcessPoolExecutor(jobs) as pool:
        if rates:
            futs = {(p, r): pool.submit(run_one, p, kw, r, wl, fleet) for p, kw in policies.items() for r in rates}
            series = {p: [futs[p, r].result() for r in rates] for p in policies}
        else:
            start = start_rate(wl, fleet)
            futs = {p: pool.submit(search, p, kw, wl, fleet, start, refine) for p, kw in policies.items()}
            series = {p: futs[p].result() for p in policies}
            passing = [r["rate_rps"] for runs in series.values() for r in runs if r["slo_attainment"] >= rep.TARGET]
            ref = max(passing) if passing else min(r["rate_rps"] for runs in series.values() for r in runs)
            extra = {
                p: pool.submit(run_one, p, policies[p], ref, wl, fleet)
                for p, runs in series.items()
                if all(r["rate_rps"] != ref for r in runs)
            }
            for p, fut in extra.items():
                series[p].append(fut.result())
    return series


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate simulate", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--workers", type=int, default=8, help="simulated workers (sim executors in virtual time)")
    p.add_argument(
        "--policies", default=",".join(BUILTIN_POLICIES), help="comma-separated policy names or module:Class specs"
    )
    p.add_argument(
        "--policy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="constructor argument for the policies that take it, e.g. pd_min_uncached_tokens=256 "
        "(repeatable; numbers are parsed, as by `kvgate gateway --policy-arg`)",
    )
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="one request rate (req/s; 0: a trace at its own timestamps)")
    rate.add_argument(
        "--sweep", nargs="?", const="auto", help="R1,R2,... rates to run, or nothing to search each policy's goodput"
    )
    add_args(p)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="a request meets its SLO within this TTFT ...")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="... and this time per output token")
    p.add_argument("--profile", help="cost-model JSON (kvgate calibrate writes one); default CostModel()")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="tokens one engine step computes at most")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests in a worker's running batch at most")
    p.add_argument("--max-model-len", type=int, default=65536, help="context length of the simulated model")
    p.add_argument(
        "--host-kv-blocks",
        type=int,
        default=0,
        help="each worker's host KV tier in blocks (a worker's --host-kv-gb); default 0: none",
    )
    p.add_argument(
        "--host-kv-gbps",
        type=float,
        default=20.0,
        help="the host tier's copy-back rate in GB/s (pinned host -> device)",
    )
    p.add_argument(
        "--host-kv-credit",
        type=float,
        help="the router's credit for a matched host-tier block (gateway --host-kv-credit; default "
        "1.0: its copy back runs beside the steps; its time, from --host-kv-gbps, delays only its request)",
    )
    p.add_argument(
        "--disk-kv-blocks",
        type=int,
        default=0,
        help="each worker's disk KV tier in blocks, under its host tier (a worker's --disk-kv-gb); default 0: none",
    )
    p.add_argument(
        "--disk-kv-gbps",
        type=float,
        default=DEFAULT_TIER_CREDITS.disk_gbps,
        help="the disk tier's read-back rate in GB/s, file -> device (gateway --disk-kv-gbps)",
    )
    p.add_argument(
        "--disk-kv-credit",
        type=float,
        default=DEFAULT_TIER_CREDITS.disk,
        help="the router's credit for a matched disk-tier block (gateway --disk-kv-credit)",
    )
    p.add_argument(
        "--kv-load-every-hit",
        action="store_true",
        help="workers copy back every host and disk hit, even where recomputing it would be faster "
        "(the worker's --kv-load-every-hit; default: the read-or-recompute choice)",
    )
    p.add_argument("--poll-ms", type=float, default=500.0, help="how often the router polls /state (gateway default)")
    p.add_argument(
        "--drain-s", type=float, default=120.0, help="virtual seconds to let requests finish after the last arrival"
    )
    p.add_argument(
        "--request-overhead-ms",
        type=float,
        help="delay from arrival to the worker's queue (default: the profile's, else 0)",
    )
    p.add_argument(
        "--roles",
        help="worker roles as ROLE:COUNT,... summing to --workers, e.g. "
        "prefill:2,decode:2 (roles: mixed, prefill, decode); default: all mixed",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=131072,
        help="KV bytes per token for P/D transfers (default 131072: Llama-3-8B in bf16)",
    )
    p.add_argument(
        "--transfer-gbps", type=float, help="P/D link speed in GB/s (default: --kv-transport's measured link, else 20)"
    )
    p.add_argument(
        "--kv-transport",
        choices=["http", "ipc", "nixl"],
        help="model P/D transfers as this transport's measured link (latency + bandwidth fitted "
        "by bench/transfer_payload.py, read from --transfer-profile)",
    )
    p.add_argument("--transfer-profile", default=DEFAULT_PROFILE, help="a bench/transfer_payload.py result")
    p.add_argument(
        "--export-batch-blocks",
        type=int,
        default=16,
        help="prefill workers ship a prompt's blocks mid-prefill in batches of at least this many, "
        "overlapping the transfer with the prefill (the worker's --kv-export-batch-blocks); 0: one "
        "transfer after the prefill",
    )
    p.add_argument(
        "--views-with-cost",
        action="store_true",
        help="give policies the cost model (the gateway does not: it sends step_ms only)",
    )
    p.add_argument(
        "--no-fast-forward", action="store_true", help="step every decode one at a time (slow; for checking)"
    )
    p.add_argument("--refine", type=int, default=3, help="bisection steps of the goodput search")
    p.add_argument("--jobs", type=int, default=2, help="simulations run in parallel processes")
    p.add_argument("--title", help="plot title")
    p.add_argument("--out", required=True, help="report JSON; plots are written next to it")
    return p


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    sim = SimConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        fast_forward=not args.no_fast_forward,
        host_blocks=args.host_kv_blocks,
        host_gbps=args.host_kv_gbps,
        disk_blocks=args.disk_kv_blocks,
        disk_gbps=args.disk_kv_gbps,
        load_every_hit=args.kv_load_every_hit,
        export_batch_blocks=args.export_batch_blocks,
    )
    profile = load_profile(args.profile) if args.profile else {}
    cost = CostModel.from_json(profile) if profile else CostModel()
    overhead = (
        args.request_overhead_ms if args.request_overhead_ms is not None else profile.get("request_overhead_ms", 0.0)
    )
    link = (
        load_link(args.kv_transport, args.transfer_profile) if args.kv_transport else TransferLink("given", 0.0, 20.0)
    )
    return FleetConfig(
        roles=parse_roles(args.roles, args.workers),
        kv_bytes_per_token=args.kv_bytes_per_token,
        transfer_gbps=args.transfer_gbps or link.gbps,
        transfer_latency_s=link.latency_s,
        workers=args.workers,
        sim=sim,
        cost=cost,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        poll_s=args.poll_ms / 1000.0,
        drain_s=args.drain_s,
        views_with_cost=args.views_with_cost,
        request_overhead_ms=overhead,
        tier_credits=tier_credits(args),
    )


def tier_credits(args: argparse.Namespace) -> TierCredits:
    """The router's tier credits: a host block's credit --host-kv-credit (default 1.0: the copy runs
    beside the steps and saves the whole prefill); a disk block's --disk-kv-credit. The rates are
    the sim workers' (--host-kv-gbps, --disk-kv-gbps), which they publish in their state."""
    host = 1.0 if args.host_kv_credit is None else args.host_kv_credit
    return TierCredits(host, args.disk_kv_credit, args.host_kv_gbps, args.disk_kv_gbps)


def parse_roles(spec: str | None, workers: int) -> tuple[str, ...] | None:
    """ "prefill:2,decode:2" -> ("prefill", "prefill", "decode", "decode")."""
    if not spec:
        return None
    roles: list[str] = []
    for part in spec.split(","):
        role, _, count = part.partition(":")
        if role not in ("mixed", "prefill", "decode"):
            sys.exit(f"kvgate simulate: unknown role {role!r} in --roles")
        roles += [role] * int(count or 1)
    if len(roles) != workers:
        sys.exit(f"kvgate simulate: --roles names {len(roles)} workers, --workers is {workers}")
    return tuple(roles)


def load_profile(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def policy_kwargs(specs: list[str], items: list[str]) -> dict[str, dict]:
    """Per policy, the --policy-arg pairs its constructor takes; every pair must be taken by
    at least one of the policies (a typo would otherwise be silently ignored). Each policy is
    built here once, so a bad value fails before any simulation starts."""
    given = parse_policy_args(items, "kvgate simulate")
    out = {}
    for spec in specs:
        params = inspect.signature(type(build_policy(spec, {}, "kvgate simulate", load_policy))).parameters
        takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
        out[spec] = {k: v for k, v in given.items() if takes_any or k in params}
        build_policy(spec, out[spec], "kvgate simulate", load_policy)
    unused = set(given) - {k for kw in out.values() for k in kw}
    if unused:
        sys.exit(f"kvgate simulate: no policy of {', '.join(specs)} takes --policy-arg {', '.join(sorted(unused))}")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    policies = policy_kwargs([p for p in args.policies.split(",") if p], args.policy_arg)
    fleet = fleet_config(args)
    rates = [args.rate] if args.rate is not None else None
    if args.sweep and args.sweep != "auto":
        rates = sorted(float(r) for r in args.sweep.split(","))
    if not rates and not args.sweep:
        sys.exit("kvgate simulate: give --rate R or --sweep [R1,R2,...]")
    rates = resolve_rates(args, rates) if rates else None
    wl = from_args(args, rates[0] if rates else 10.0)
    t0 = time.perf_counter()
    series = sweep(policies, rates, wl, fleet, args.refine, args.jobs)
    title = args.title or f"{args.workload}, {args.workers} simulated workers"
    meta = {
        "kind": "simulate",
        "title": title,
        "command": "kvgate simulate " + " ".join(argv or sys.argv[1:]),
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "workers": args.workers,
        "policy_args": policies,
        "workload": {k: v for k, v in asdict(wl).items() if k != "rate"},
        "fleet": {
            "sim": asdict(fleet.sim),
            "cost": fleet.cost.to_json(),
            "profile": args.profile,
            "poll_s": fleet.poll_s,
            "views_with_cost": fleet.views_with_cost,
            "request_overhead_ms": fleet.request_overhead_ms,
            "roles": args.roles,
            "kv_bytes_per_token": fleet.kv_bytes_per_token,
            "transfer_gbps": fleet.transfer_gbps,
            "transfer_latency_s": fleet.transfer_latency_s,
            "kv_transport": args.kv_transport,
            "tier_credits": asdict(fleet.tier_credits),
        },
        "wall_s": time.perf_counter() - t0,
    }
    rep.publish(series, meta, args.out)
