"""What a router with perfect knowledge gets on a KV-pool-bound fleet (issue 16 point 7).

The oracle reads each simulated worker's true pool and queue (not a policy's view: free
blocks, every running request's remaining growth and steps, every waiting one) and simulates
that worker's first-come-first-served pool to find when a new request would start; it routes
to the earliest start and refuses a request whose start would be past `--budget-s` (a larger
one, over `--big-tokens`, past `--big-budget-s`: refusing large requests first frees the most
room per refusal). It is an upper bound for route-on-arrival plus refusal, not a policy:
no gateway sees this state. Run beside `pool_bound.py`'s Little's-law ceiling, it says how
much of the gap between slo_goodput and that ceiling any router could close.

Each refusal is also weighed against the whole fleet's room: `fragmented` counts those the
fleet's free blocks together (each worker's free less what its running requests will still
grow into and its queue will take) would have held at once, what moving running requests
between workers (Llumnix-style migration) could at most win back beyond routing.

`--queue smallest|arrival` makes it a gateway-side queue instead (late binding, as llm-d's
flow control holds requests): a request waits in the router, not at a worker, and is sent
when some worker's true pool can start it at once; the queue is served smallest prompt first
or in arrival order, and a request that has waited past its budget is refused. That asks
whether holding requests back and choosing which to admit beats routing on arrival.

    PYTHONPATH=. python experiments/pool_oracle.py --rates 20,21,22,23 --big-tokens 2300 \\
        --big-budget-s 0.5 --budget-s 1.9 --out /tmp/pool-oracle.json
"""

import argparse
import json
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.fleet_sim import FleetConfig, FleetSim
from bench.report import summarize
from bench.sim_worker import SimConfig, SimWorker
from bench.workloads import BenchRequest, WorkloadConfig, generate
from policies.api import FleetView, RequestView, Route
from policies.ledger import first_come_start
from workers.kv.cost_model import CostModel


class Oracle:
    """Earliest simulated start across the fleet's true pools; refuse past the budget."""

    name = "pool_oracle"

    def __init__(self, args: argparse.Namespace, shared_blocks: int, block_size: int):
        self.args, self.shared, self.block = args, shared_blocks, block_size
        self.sim: FleetSim | None = None
        self.refused = self.fragmented = 0

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block)

    def start_s(self, w: SimWorker, prompt: int, out: int) -> float:
        """When a request of `prompt` + `out` tokens would start on `w`: running requests end
        after their remaining steps and give back their private blocks, queued ones before it
        take theirs in order (the shared prefix's blocks stay cached)."""
        step_s = self.args.step_ms / 1000.0
        free = w.pool.num_free
        ends: list[tuple[float, int]] = []
        for r in w.scheduler.running:
            full = self.blocks(len(r.prompt_ids) + r.params.max_tokens)
            free -= max(0, full - len(r.blocks))
            left = r.params.max_tokens - (len(r.token_ids) - len(r.prompt_ids))
            ends.append((left * step_s, full - self.shared))
        queued = [(len(r.prompt_ids), r.params.max_tokens) for r in [*w.scheduler.waiting, *w.inbox]]
        needs = [(self.blocks(n + steps) - self.shared, steps) for n, steps in [*queued, (prompt, out)]]
        return first_come_start(free, ends, needs, step_s)

    def room(self, w: SimWorker) -> int:
        """Blocks of `w` no running request will grow into and no queued one will take."""
        free = w.pool.num_free
        for r in w.scheduler.running:
            free -= max(0, self.blocks(len(r.prompt_ids) + r.params.max_tokens) - len(r.blocks))
        for r in [*w.scheduler.waiting, *w.inbox]:
            free -= self.blocks(len(r.prompt_ids) + r.params.max_tokens) - self.shared
        return max(0, free)

    def budget_s(self, prompt_tokens: int) -> float:
        """How long a request may wait to start before it is refused."""
        big = prompt_tokens > self.args.big_tokens
        return self.args.big_budget_s if big else self.args.budget_s

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        assert self.sim is not None, "run() sets the simulation"
        start, i = min((self.start_s(w, req.num_tokens, req.max_tokens), i) for i, w in enumerate(self.sim.workers))
        if start > self.budget_s(req.num_tokens):
            self.refused += 1
            need = self.blocks(req.num_tokens + req.max_tokens) - self.shared
            self.fragmented += sum(map(self.room, self.sim.workers)) >= need
            return Route(reject=f"start in {start:.2f} s")
        return Route(worker=self.sim.workers[i].worker_id)


class QueuedFleet(FleetSim):
    """The simulated fleet behind a gateway-side queue (`--queue`): an arriving request joins
    the queue; whenever one arrives or a worker finishes one, the queue is served in its order
    and each request goes to a worker whose true pool starts it at once, if any; a request
    waiting past its budget is refused. Sent, it keeps its arrival time, so its TTFT counts the
    wait in the queue."""

    def __init__(self, oracle: Oracle, cfg: FleetConfig, order: str):
        self.placed = Placed()
        super().__init__(self.placed, cfg)
        self.oracle, self.order = oracle, order
        self.queue: list[BenchRequest] = []

    def route(self, br: BenchRequest) -> None:
        self.now = max(self.now, br.arrival_s)
        self.queue.append(br)
        self.serve()

    def on_ended(self) -> None:
        """Serve the queue after each event in which requests ended."""
        self.serve()

    def serve(self) -> None:
        """Refuse what waited past its budget, then send each waiting request, in the queue's
        order, to a worker that starts it at once."""
        now, waiting = self.now, []
        for br in self.queue:
            if now - br.arrival_s > self.oracle.budget_s(len(br.prompt)):
                self.failed(br.arrival_s, len(br.prompt), f"rejected: waited {now - br.arrival_s:.2f} s")
            else:
                waiting.append(br)
        if self.order == "smallest":
            waiting.sort(key=lambda b: len(b.prompt))
        self.queue = []
        for br in waiting:
            start, i = min(
                (self.oracle.start_s(w, len(br.prompt), br.max_tokens), i) for i, w in enumerate(self.workers)
            )
            if start > 0.0:
                self.queue.append(br)
                continue
            self.placed.worker = self.workers[i].worker_id
            super().route(replace(br, arrival_s=now))
            self.live[str(br.index)][0].arrival = br.arrival_s

    def run(
        self, requests: Iterable[BenchRequest], duration_s: float, progress: Callable[[float, int], None] | None = None
    ) -> list[dict]:
        records = super().run(requests, duration_s, progress)
        for br in self.queue:
            self.failed(br.arrival_s, len(br.prompt), "unfinished: still queued when the simulation stopped")
        return records


class Placed:
    """The policy behind `QueuedFleet`: the worker the queue chose."""

    name = "queued"
    worker = ""

    def route(self, req: RequestView, fleet: FleetView) -> Route:
        return Route(worker=self.worker)


def attainment(job: tuple[argparse.Namespace, float, int]) -> tuple[float, int, int]:
    """(SLO attainment, refusals, refusals the fleet's room together would have held) of one run."""
    args, rate, seed = job
    sim_cfg = SimConfig(num_blocks=args.num_blocks)
    wl = WorkloadConfig(name=args.workload, rate=rate, duration_s=args.duration, seed=seed)
    fleet = FleetConfig(
        workers=args.workers,
        sim=sim_cfg,
        cost=CostModel.load(args.profile),
        views_with_cost=True,
        slo_ttft_ms=2000.0,
        slo_tpot_ms=100.0,
    )
    oracle = Oracle(args, (wl.get("prefix_len") or 0) // sim_cfg.block_size, sim_cfg.block_size)
    sim = oracle.sim = QueuedFleet(oracle, fleet, args.queue) if args.queue else FleetSim(oracle, fleet)
    att = summarize(sim.run(generate(wl), args.duration), 2000.0, 100.0)["slo_attainment"]
    return att, oracle.refused, oracle.fragmented


def plot(report: dict, path: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    rates = list(report["attainment"])
    order = {"smallest": "smallest prompt first", "arrival": "in arrival order"}.get(report.get("queue") or "")
    label = f"pool oracle, gateway queue ({order})" if order else "pool oracle"
    ax.plot(rates, [report["attainment"][r] for r in rates], marker="o", label=label)
    ax.axhline(0.9, color="black", linewidth=0.5)
    ax.set(
        xlabel="request rate (req/s)",
        ylabel="SLO attainment",
        title=f"{report['workload']}: a router that knows the pools",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="multi-turn")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[20, 21, 22, 23])
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--profile", default="bench/profiles/h200-llama8b-kvgate-eager.json")
    p.add_argument("--step-ms", type=float, default=22.5, help="decode step at this load (measured 22-25 ms)")
    p.add_argument("--budget-s", type=float, default=1.9, help="refuse a request that would start later")
    p.add_argument("--big-tokens", type=int, default=10**9, help="a prompt over this is refused sooner")
    p.add_argument("--big-budget-s", type=float, default=0.5)
    p.add_argument(
        "--queue", choices=("smallest", "arrival"), help="hold requests in a gateway-side queue, served in this order"
    )
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    jobs = [(args, r, s) for r in args.rates for s in range(args.seeds)]
    with ProcessPoolExecutor(args.jobs) as ex:
        got = list(ex.map(attainment, jobs))
    runs = {r: got[i * args.seeds : (i + 1) * args.seeds] for i, r in enumerate(args.rates)}
    by_rate = {r: sum(a for a, _, _ in g) / args.seeds for r, g in runs.items()}
    refusals = {r: {"refused": sum(n for _, n, _ in g), "fragmented": sum(f for _, _, f in g)} for r, g in runs.items()}
    report = {k: v for k, v in vars(args).items() if k != "out"} | {"attainment": by_rate, "refusals": refusals}
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report, str(Path(args.out).with_suffix(".png")))
    print(json.dumps({r: round(a, 3) for r, a in by_rate.items()}), json.dumps(refusals))


if __name__ == "__main__":
    main()
