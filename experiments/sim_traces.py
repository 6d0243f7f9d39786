"""Per-request traces of one simulated run at vs_peers' configuration, and the capacity bound of
a shared-prefix fleet (issue 16, point 7).

    python experiments/sim_traces.py trace POLICY RATE WORKLOAD [key=value ...] [--option=value ...] [--out FILE]
    python experiments/sim_traces.py bound RATE [cap]

`trace` wraps the policy and the fleet simulator: per request, when it came, its group or
session, where it went and why (the route's reason, predicted TTFT, the views of every worker
it was chosen among), and what happened (TTFT, TPOT, cached tokens, preemptions); then prints
requests, hits and SLO misses per worker and where each group went.

`bound` is not a policy: it pins shared-prefix group g to worker g % 4 (each prefix held once,
the best placement there is, which cache_aware reaches) and refuses a request when its
worker already has `cap` requests in flight (default: none), so it shows what the fleet can
serve at all: how many requests complete per second once its pools are full.
"""

import json
import sys
from collections import Counter, defaultdict

from bench.fleet_sim import FleetSim
from bench.report import summarize
from bench.simulate import fleet_config, parser
from bench.workloads import from_args, generate
from policies.api import FleetView, RequestView, Route
from policies.registry import load_policy

VS_PEERS = "--workers 4 --profile bench/profiles/h200-llama8b-kvgate-eager.json --num-blocks 1024 --views-with-cost --duration 15 --slo-ttft-ms 2000 --slo-tpot-ms 100"


class GroupPinned:
    """Shared-prefix group g to worker g % n; refused past `cap` requests in flight there."""

    name = "group_pinned"

    def __init__(self, cap: float = float("inf")) -> None:
        self.cap = cap

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        w = fleet.workers[int((req.session_id or "group-0").split("-")[1]) % len(fleet.workers)]
        return Route(reject="in-flight cap") if w.in_flight >= self.cap else Route(worker=w.worker_id)


def simulate(policy, workload: str, rate: float, extra: tuple[str, ...] = ()) -> tuple[list[dict], dict, FleetSim]:
    """One run; `extra` are more `kvgate simulate` options (e.g. --seed 5 --duration 20)."""
    args = parser().parse_args(VS_PEERS.split() + ["--workload", workload, "--rate", str(rate), "--out", "-", *extra])
    fleet = fleet_config(args)
    wl = from_args(args, rate)
    sim = FleetSim(policy, fleet)
    routes: dict[str, dict] = {}
    by_time: dict[float, dict] = {}  # refusals' records carry no request id, only their arrival
    decide = policy.route

    def traced(req: RequestView, view: FleetView) -> Route:
        r = decide(req, view)
        routes[req.request_id] = by_time[view.now] = dict(
            t=view.now,
            group=req.session_id,
            worker=r.worker,
            prefill=r.prefill,
            reject=r.reject,
            reason=r.reason,
            predicted_ttft_ms=r.predicted_ttft_ms,
            views={
                w.worker_id: dict(
                    matched=w.matched_blocks,
                    free=w.free_blocks,
                    shared=w.shared_blocks,
                    running=w.running,
                    waiting=w.waiting,
                    in_flight=w.in_flight,
                    queued_tokens=w.queued_prefill_tokens,
                )
                for w in view.workers
            },
        )
        return r

    policy.route = traced
    finished = sim._finished

    def record(req, now: float, i: int) -> None:
        n = len(sim.records)
        finished(req, now, i)
        if len(sim.records) > n:
            sim.records[-1].update(request_id=req.request_id, done_s=now, preemptions=req.num_preemptions)

    sim._finished = record
    records = sim.run(generate(wl.with_rate(rate)), wl.duration_s)
    for r in records:
        r.update(routes.get(r.get("request_id", ""), by_time.get(r["arrival_s"], {})))
    return records, summarize(records, fleet.slo_ttft_ms, fleet.slo_tpot_ms), sim


def met(r: dict) -> bool:
    return r["error"] is None and r["ttft_ms"] <= 2000.0 and r["tpot_ms"] <= 100.0


def trace(policy: str, rate: float, workload: str, items: list[str]) -> None:
    out = next((items[i + 1] for i, a in enumerate(items) if a == "--out"), None)
    kwargs = {k: json.loads(v) for k, v in (a.split("=", 1) for a in items if "=" in a and not a.startswith("--"))}
    extra = [a.split("=", 1) for a in items if a.startswith("--") and "=" in a]
    records, summary, _ = simulate(load_policy(policy, **kwargs), workload, rate, tuple(x for kv in extra for x in kv))
    print(f"{policy} {kwargs} {workload} @ {rate:g} req/s: attainment {summary['slo_attainment']:.3f}")
    per: dict[str, Counter] = defaultdict(Counter)
    groups: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        w = r["worker"] or "refused"
        per[w].update(requests=1, hits=r["cached_tokens"] > 0, met=r["worker"] is not None and met(r))
        per[w]["preempted"] += r.get("preemptions", 0) > 0
        groups[r.get("group") or "-"][w] += 1
    for w, c in sorted(per.items()):
        print(f"  {w}: {dict(c)}")
    for g, c in sorted(groups.items()):
        print(f"  {g}: {dict(c)}")
    if out:
        with open(out, "w") as f:
            json.dump(records, f)


def bound(rate: float, cap: float) -> None:
    records, summary, _ = simulate(GroupPinned(cap), "shared-prefix", rate)
    done = [r for r in records if r["error"] is None and 5.0 <= r["done_s"] < 15.0]
    admitted = [r for r in records if r["worker"] is not None]
    print(
        f"group-pinned, cap {cap:g} in flight, shared-prefix @ {rate:g} req/s: attainment "
        f"{summary['slo_attainment']:.3f}, admitted {len(admitted)} of {len(records)} "
        f"({sum(map(met, admitted)) / max(1, len(admitted)):.3f} met), "
        f"{len(done) / 10.0:.1f} completions/s in 5-15 s"
    )


if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "trace":
        trace(rest[0], float(rest[1]), rest[2], rest[3:])
    else:
        bound(float(rest[0]), float(rest[1]) if len(rest) > 1 else float("inf"))
