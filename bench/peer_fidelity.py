"""The simulator against a finished `bench.vs_peers` run: for each kvgate policy and workload,
the goodput `kvgate simulate` predicts for the same fleet, profile, pool, SLOs, seeded workload
and rates, against the real fleet's.

Two predictions per policy: with the profile as measured, and with it rescaled to the steps the
real workers ran at each rate (`bench.calibrate.rescale`: the same shape, the speed of that
run's own steps, read from each worker's GET /steps). On a 2-core machine shared by four Python
workers, a router and the load generator, the workers' steps run slower than their profile
says; the rescaled prediction is the simulator given what calibration on that machine would
have measured, the as-measured one what it predicts from the profile alone.

    python -m bench.vs_peers --fidelity-only --out bench/results/vs-peers.json
"""

import json
import sys
from pathlib import Path

import httpx

from bench import report as rep
from bench.calibrate import rescale
from bench.fleet_sim import FleetConfig
from bench.sim_worker import SimConfig
from bench.simulate import run_one as sim_one
from bench.workloads import WorkloadConfig
from workers.internal_auth import TOKEN_HEADER
from workers.kv.cost_model import CostModel
from workers.step_stats import StepRecord


def step_mark(url: str, token: str) -> int:
    """The worker's last step number (GET /steps), to read the steps of a run after it."""
    r = httpx.get(f"{url}/steps", params={"after": 1 << 62}, headers={TOKEN_HEADER: token}, timeout=30)
    return int(r.json()["last"])


def step_speed(profile_path: str, marks: list[tuple[str, int]], token: str) -> dict | None:
    """The rescale factors (prefill, decode, overall) of the profile to the steps every worker
    ran since its mark; None when no worker stepped. The workers keep their last steps only
    (STEP_LOG), which a 15 s run at these rates stays within."""
    steps: list[StepRecord] = []
    for url, after in marks:
        got = httpx.get(f"{url}/steps", params={"after": after}, headers={TOKEN_HEADER: token}, timeout=30).json()
        steps += [StepRecord.from_json(s) for s in got["steps"]]
    if not steps:
        return None
    scaled = rescale(json.loads(Path(profile_path).read_text()), steps)["rescaled"]
    return {k: scaled[k] for k in ("prefill", "decode", "overall", "steps")}


def fleet_for(summary: dict, profile: dict, speed: dict | None) -> FleetConfig:
    """The run's fleet in the simulator, its cost model rescaled by `speed` when given."""
    cost = CostModel.from_json(profile)
    overhead = profile.get("request_overhead_ms", 0.0)
    if speed:
        cost = cost.scaled(speed["prefill"], speed["decode"])
        overhead *= speed["overall"]
    return FleetConfig(
        workers=summary["workers"],
        sim=SimConfig(num_blocks=summary["num_blocks"]),
        cost=cost,
        slo_ttft_ms=summary["slo_ttft_ms"],
        slo_tpot_ms=summary["slo_tpot_ms"],
        views_with_cost=True,
        request_overhead_ms=overhead,
    )


def fidelity(summary_path: str) -> dict:
    """Per workload and kvgate policy: simulated goodput as measured and rescaled to each rate's
    steps, the real goodput, and their ratios."""
    summary = json.loads(Path(summary_path).read_text())
    profile = json.loads(Path(summary["profile"]).read_text())
    out = {}
    for wl, name in summary["reports"].items():
        report = rep.read_json(Path(summary_path).parent / name)
        cfg = WorkloadConfig(name=wl, duration_s=summary["duration_s"], seed=0)
        for label, entry in report["policies"].items():
            if not label.startswith("kvgate-"):
                continue
            policy, real = label.removeprefix("kvgate-"), entry["goodput_rps"]
            row: dict = {"real_goodput_rps": real}
            for key, speeds in (
                ("", [None] * len(entry["runs"])),
                ("rescaled_", [r.get("step_speed") for r in entry["runs"]]),
            ):
                if key and not any(speeds):
                    continue
                runs = [
                    sim_one(policy, {}, r["rate_rps"], cfg, fleet_for(summary, profile, s), quiet=True)
                    for r, s in zip(entry["runs"], speeds)
                ]
                simulated, _ = rep.goodput([(r["rate_rps"], r["slo_attainment"]) for r in runs])
                row[f"simulated_{key}goodput_rps"] = simulated
                row[f"{key}ratio"] = simulated / real if real else None
                row[f"{key}attainment"] = [(r["rate_rps"], r["slo_attainment"]) for r in runs]
            out.setdefault(wl, {})[label] = row
    return out


def add_fidelity(path: str) -> None:
    """`fidelity` of the run summarised at `path`, written into it as `simulator_fidelity`."""
    out = json.loads(Path(path).read_text())
    out["simulator_fidelity"] = fidelity(path)
    Path(path).write_text(json.dumps(rep._clean(out), indent=1))
    ratios = {
        w: {k: (v["ratio"], v.get("rescaled_ratio")) for k, v in s.items()}
        for w, s in out["simulator_fidelity"].items()
    }
    print(json.dumps(ratios, indent=1), file=sys.stderr)
