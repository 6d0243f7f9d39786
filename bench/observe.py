"""The dashboard, rules and metrics checked against a real Prometheus, as an operator would.

Two gateways (`slo_goodput` disaggregating long prompts over a prefill/decode pair and a mixed
worker; `prefix_affinity` over two mixed workers, on a redis-server of its own as a replica
would be, so the Redis panel has a gateway to show) and four sim workers, scraped every second
by Prometheus with kvgate's recording rules and alerts (their `for:` cut to 0 s). A bounded
client load runs through both gateways; one worker is SIGKILLed half-way, mid-stream. Then every panel
query of grafana/dashboards/kvgate.json is evaluated over the run as Grafana would send it and
judged: it returns data, ratios stay in 0..1, latencies are sane; the error panels show the
kill; the gateway's TTFT and end-to-end quantiles match the client's own within a histogram
bucket; every recording rule returns values in range and the worker-down alert fires.

    python -m bench.observe --out bench/results/observe.json --png bench/results/dashboard.png
"""

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from bench.prom import RATIO_UNITS, RULES, Prom, panel_queries, quick_rules, start_prometheus, values_of
from gateway.metrics import LATENCY_BUCKETS
from gateway.procs import Proc, Worker, start_gateway, start_redis, stop_all, wait_redis

MODEL = "smollm2-135m"
SECRET = ("--internal-token", "observe-fleet-token")
ERROR_PANEL = "Errors/s"
HEALTH_PANEL = "Worker health and in-flight"


@dataclass
class Sent:
    gateway: str
    stream: bool
    status: int
    start: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: bool = False


def body(rng: random.Random, long_share: float, stream: bool) -> dict:
    """A completion over token ids sharing one of four 32-token prefixes; some prompts long
    enough that slo_goodput moves their prefill to the prefill worker."""
    n = rng.randint(160, 240) if rng.random() < long_share else rng.randint(8, 48)
    prefix = [1000 + 7 * rng.randrange(4) + i for i in range(32)]
    return {
        "model": MODEL,
        "prompt": prefix + [rng.randrange(2000, 30000) for _ in range(n)],
        "max_tokens": rng.randint(4, 16),
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
    }


async def one(
    session: aiohttp.ClientSession, name: str, url: str, b: dict, routed: Callable[[str], None] | None = None
) -> Sent:
    """One completion through a gateway, timed as the client sees it; `routed` is told the
    worker the gateway chose, as soon as the response starts."""
    s = Sent(name, b["stream"], 0, time.monotonic())
    try:
        async with session.post(url + "/v1/completions", json=b) as r:
            s.status = r.status
            if routed:
                routed(r.headers.get("x-kvgate-worker", ""))
            if not b["stream"]:
                await r.read()
            else:
                async for line in r.content:
                    if line.startswith(b"data: ") and s.ttft_s is None:
                        s.ttft_s = time.monotonic() - s.start
                    s.error |= line.startswith(b'data: {"error"')
    except (aiohttp.ClientError, asyncio.TimeoutError):
        s.error = True
    s.e2e_s = time.monotonic() - s.start
    return s


async def drive(gateways: dict[str, tuple[str, float, float]], until: float, concurrency: int) -> list[Sent]:
    """Closed-loop clients per gateway ({name: (url, stream share, long-prompt share)}) until
    `until` (monotonic)."""
    sent: list[Sent] = []

    async def loop(name: str, url: str, stream_share: float, long_share: float, seed: int) -> None:
        rng = random.Random(seed)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            while time.monotonic() < until:
                sent.append(await one(session, name, url, body(rng, long_share, rng.random() < stream_share)))

    await asyncio.gather(
        *(
            loop(name, url, st, lg, 10 * i + c)
            for i, (name, (url, st, lg)) in enumerate(gateways.items())
            for c in range(concurrency)
        )
    )
    return sent


async def kill_mid_stream(
    url: str, victim: str, kill: Callable[[], None], at: float, tries: int = 8
) -> tuple[float, list[Sent]]:
    """At `at` (monotonic), open long streaming requests through the gateway one at a time until
    one streams from `victim`, then kill it: the kill always breaks a request in flight, which
    the error panels must show (a kill between requests would leave nothing to count, since the
    gateway drops a dead worker as its long poll breaks). Returns the kill's wall time and the
    requests, each read to its end."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    rng = random.Random(7)
    on_victim = asyncio.Event()

    def routed(worker: str) -> None:
        if worker == victim:
            on_victim.set()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        tasks = []
        for _ in range(tries):
            b = body(rng, 0.0, True) | {"max_tokens": 1000}
            tasks.append(asyncio.create_task(one(session, "gw-pa", url, b, routed)))
            try:
                await asyncio.wait_for(on_victim.wait(), 1.0)
                break
            except asyncio.TimeoutError:
                continue
        await asyncio.to_thread(kill)
        killed = time.time()
        return killed, list(await asyncio.gather(*tasks))


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(q * len(xs) + 0.5) - 1))]


def bucket_range(x: float, slack: int = 1) -> tuple[float, float]:
    """The histogram bucket holding `x`, widened by `slack` buckets each side: where Prometheus'
    interpolated quantile of the same samples must fall."""
    bounds = (0.0, *LATENCY_BUCKETS, float("inf"))
    i = next(i for i in range(1, len(bounds)) if x <= bounds[i])
    return bounds[max(0, i - 1 - slack)], bounds[min(len(bounds) - 1, i + slack)]


@dataclass
class Fleet:
    workers: dict[str, Worker]
    gateways: dict[str, object]
    redis: Proc

    def procs(self) -> list:
        return [*self.gateways.values(), *self.workers.values(), self.redis]


def start_fleet(logs: str) -> Fleet:
    w = {
        name: Worker(worker_id=name, log_dir=logs, extra=[*SECRET, *(("--role", role) if role else ())])
        for name, role in (("m0", None), ("m1", None), ("p0", "prefill"), ("d0", "decode"))
    }
    urls = {n: x.url for n, x in w.items()}
    redis = wait_redis(start_redis(log_dir=logs))
    g = {
        "gw-pd": start_gateway(
            [urls["m0"], urls["p0"], urls["d0"]],
            "slo_goodput",
            log_dir=logs,
            name="gw-pd",
            extra=[
                *SECRET,
                "--pd-min-uncached-tokens",
                "96",
                "--slo-ttft-ms",
                "2000",
                "--slo-tpot-ms",
                "200",
                "--fleet-summary-s",
                "0",
            ],
        ),
        "gw-pa": start_gateway(
            [urls["m0"], urls["m1"]],
            "prefix_affinity",
            redis=f"redis://127.0.0.1:{redis.port}/0",
            log_dir=logs,
            name="gw-pa",
            extra=[*SECRET, "--slo-ttft-ms", "300", "--slo-tpot-ms", "60", "--fleet-summary-s", "0"],
        ),
    }
    return Fleet(w, g, redis)


def run(duration_s: float = 30.0, kill_at_s: float = 12.0, concurrency: int = 3, logs: str | None = None) -> dict:
    """Start everything, load it, kill m1, evaluate; returns the report (its `problems` empty
    when every check held)."""
    logs = logs or tempfile.mkdtemp(prefix="kvgate-observe-")
    fleet = start_fleet(logs)
    prom_proc = None
    try:
        for x in fleet.workers.values():
            x.ready()
        for g in fleet.gateways.values():
            g.wait_ready()
        for name, n in (("gw-pd", 3), ("gw-pa", 2)):
            g = fleet.gateways[name]
            g.wait_healthy(n, what=f"{name} fleet")
        rules = quick_rules(RULES, Path(logs) / "rules.yml")
        prom_proc, prom = start_prometheus(
            {
                "kvgate-gateway": [g.url for g in fleet.gateways.values()],
                "kvgate-worker": [x.url for x in fleet.workers.values()],
            },
            [rules],
            logs,
        )
        prom.wait_scraped(["kvgate-gateway", "kvgate-worker"])
        time.sleep(2)  # a few scrapes of the idle fleet: every counter's 0 is in the TSDB
        start, t0 = time.time(), time.monotonic()
        gws = {"gw-pd": (fleet.gateways["gw-pd"].url, 0.5, 0.35), "gw-pa": (fleet.gateways["gw-pa"].url, 1.0, 0.0)}

        async def load() -> tuple[float, list[Sent]]:
            killing = kill_mid_stream(gws["gw-pa"][0], "m1", fleet.workers["m1"].kill, t0 + kill_at_s)
            sent, (killed, broken) = await asyncio.gather(drive(gws, t0 + duration_s, concurrency), killing)
            return killed, sent + broken

        killed, sent = asyncio.run(load())
        time.sleep(4)  # the last requests' scrapes and rule evaluations
        end = time.time()
        report = evaluate(prom, sent, start, killed, end, fleet.gateways["gw-pa"].url)
        report["load"] = load_summary(sent, duration_s)
        return report
    finally:
        stop_all(([prom_proc] if prom_proc else []) + fleet.procs())


def load_summary(sent: list[Sent], duration_s: float) -> dict:
    by = {}
    for s in sent:
        key = f"{s.gateway} {s.status}{' error' if s.error else ''}"
        by[key] = by.get(key, 0) + 1
    return {"requests": len(sent), "per_s": round(len(sent) / duration_s, 1), "by_gateway_status": by}


def evaluate(prom: Prom, sent: list[Sent], start: float, killed: float, end: float, pa_url: str) -> dict:
    problems: list[str] = []
    panels = []
    for pq in panel_queries("4s"):
        try:
            result = prom.query_range(pq.expr, start - 5, end, 1.0)
        except ValueError as e:
            problems.append(f"{pq.panel} / {pq.legend}: {e}")
            continue
        vals = values_of(result)
        low, high = (0.0, 1.0) if pq.unit in RATIO_UNITS else (0.0, 120.0) if pq.unit == "s" else (0.0, float("inf"))
        entry = {
            "panel": pq.panel,
            "legend": pq.legend,
            "unit": pq.unit,
            "series": len(result),
            "points": len(vals),
            "min": min(vals, default=None),
            "max": max(vals, default=None),
            "result": result,
        }
        if not vals:
            problems.append(f"{pq.panel} / {pq.legend}: no data")
        elif min(vals) < low - 1e-9 or max(vals) > high + 1e-9:
            problems.append(f"{pq.panel} / {pq.legend}: values {min(vals):.4g}..{max(vals):.4g} outside {low}..{high}")
        panels.append(entry)
    after_kill = [
        v
        for e in panels
        if e["panel"] == ERROR_PANEL
        for s in e["result"]
        for t, v in s["values"]
        if float(t) > killed and float(v) > 0
    ]
    if not after_kill:
        problems.append("the error panel shows nothing after the worker was killed")
    down = [
        v
        for e in panels
        if e["panel"] == HEALTH_PANEL and e["legend"].startswith("healthy")
        for s in e["result"]
        if s["metric"].get("worker") == "m1"
        for t, v in s["values"]
        if float(t) > killed and float(v) == 0
    ]
    if not down:
        problems.append("the health panel never shows the killed worker out")
    latency = compare_latency(prom, sent, start, end, pa_url, problems)
    rules = check_rules(prom, end, problems)
    return {
        "problems": problems,
        "panels": panels,
        "latency": latency,
        "rules": rules,
        "window": {"start": start, "killed": killed, "end": end},
    }


def compare_latency(prom: Prom, sent: list[Sent], start: float, end: float, pa_url: str, problems: list[str]) -> list:
    """The TTFT and end-to-end panels' quantiles over the whole run, for the streaming-only
    gateway, against the client's quantiles of the same (answered, unbroken) requests."""
    ok = [s for s in sent if s.gateway == "gw-pa" and s.status == 200 and not s.error]
    window = f"{int(end - start) + 10}s"
    instance = pa_url.split("://", 1)[-1]
    out = []
    for panel, attr in (("TTFT at the gateway", "ttft_s"), ("End-to-end latency at the gateway", "e2e_s")):
        client = [getattr(s, attr) for s in ok if getattr(s, attr) is not None]
        for pq in panel_queries(window, {"gateway": instance}):
            if pq.panel != panel or pq.legend not in ("p50", "p90"):
                continue
            q = float(pq.legend[1:]) / 100
            got = values_of(prom.query(pq.expr, end))
            want = quantile(client, q) if client else None
            lo, hi = bucket_range(want) if want is not None else (None, None)
            out.append(
                {
                    "panel": panel,
                    "quantile": pq.legend,
                    "client_s": want,
                    "prometheus_s": got[0] if got else None,
                    "bucket_with_slack": [lo, hi],
                    "client_requests": len(client),
                }
            )
            if not got or want is None or not lo <= got[0] <= hi:
                problems.append(f"{panel} {pq.legend}: Prometheus {got} vs the client's {want} (allowed {lo}..{hi})")
    return out


def check_rules(prom: Prom, end: float, problems: list[str]) -> dict:
    """Every recording rule returns values in range; every alert evaluates; the worker-down
    alert fired."""
    out: dict = {"records": {}, "alerts": {}}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                vals = values_of(prom.query(rule["record"], end))
                out["records"][rule["record"]] = [min(vals), max(vals)] if vals else None
                ratio = rule["record"].endswith("ratio_rate5m")
                if not vals:
                    problems.append(f"recording rule {rule['record']}: no data")
                elif min(vals) < 0 or (ratio and max(vals) > 1 + 1e-9):
                    problems.append(f"recording rule {rule['record']}: {vals} out of range")
            else:
                try:
                    out["alerts"][rule["alert"]] = len(prom.query(rule["expr"], end))
                except ValueError as e:
                    problems.append(f"alert {rule['alert']}: {e}")
    fired = prom.query_range('ALERTS{alertname="KvgateWorkerDown",alertstate="firing"}', end - 60, end, 1.0)
    out["worker_down_fired_for"] = sorted({s["metric"].get("worker") or s["metric"].get("instance") for s in fired})
    if not fired:
        problems.append("KvgateWorkerDown never fired")
    return out


def plot(report: dict, path: str) -> None:
    """Each panel's series over the run, as the dashboard would draw them, with the kill marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = list(dict.fromkeys(e["panel"] for e in report["panels"]))
    cols = 3
    rows = -(-len(titles) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 2.8 * rows))
    w = report["window"]
    for ax, title in zip(axes.flat, titles):
        for e in (e for e in report["panels"] if e["panel"] == title):
            for s in e["result"]:
                label = e["legend"]
                for k, v in s["metric"].items():
                    label = label.replace("{{" + k + "}}", v)
                xs = [float(t) - w["start"] for t, _ in s["values"]]
                ys = [float(v) for _, v in s["values"]]
                ax.plot(xs, ys, label=label if any(ys) else None, linewidth=1)  # all-zero series: no legend
        ax.axvline(w["killed"] - w["start"], color="red", linestyle=":", linewidth=1)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=5, loc="upper left", ncol=2)
    for ax in list(axes.flat)[len(titles) :]:
        ax.axis("off")
    fig.suptitle("kvgate dashboard panels from a real Prometheus run (red: worker m1 SIGKILLed; x: seconds)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--kill-at-s", type=float, default=12.0)
    p.add_argument("--concurrency", type=int, default=3, help="closed-loop clients per gateway")
    p.add_argument("--out", default="observe.json")
    p.add_argument("--png", default="dashboard.png")
    args = p.parse_args(argv)
    report = run(args.duration_s, args.kill_at_s, args.concurrency)
    plot(report, args.png)
    slim = {k: v for k, v in report.items() if k != "panels"}
    slim["panels"] = [{k: v for k, v in e.items() if k != "result"} for e in report["panels"]]
    Path(args.out).write_text(json.dumps(slim, indent=1))
    print(json.dumps({"problems": report["problems"], "latency": report["latency"], "load": report["load"]}, indent=1))
    return report


if __name__ == "__main__":
    main()
