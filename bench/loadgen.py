"""`kvgate bench serve`: an open-loop, streaming load generator for any OpenAI endpoint.

    kvgate bench serve --url http://127.0.0.1:8000 --workload shared-prefix --sweep 1,2,4 \\
        --duration 60 --slo-ttft-ms 2000 --slo-tpot-ms 200 --out bench/results/serve.json

Open loop: each request is sent at its arrival time whatever happened to earlier ones, so a
slow server builds a queue instead of slowing the client down (a closed loop would hide
overload). Prompts go as token-id lists to /v1/completions with `stream: true`,
`ignore_eos: true` and usage in the last chunk; the SLOs ride along as `x-slo-ttft-ms` /
`x-slo-tpot-ms` headers for SLO-aware routers. Several `--url`s are used round-robin from the
client (a fleet without a router). Per request: TTFT, TPOT, inter-token latencies,
end-to-end, cached tokens, the worker that served it (`x-kvgate-worker`), errors.

The client is the gateway's own HTTP/1.1 pool (gateway/upstream.py: asyncio, httptools' C
parser) on uvloop: a client that parses every streamed event in Python costs as much CPU as
the router it measures and, on a small machine, measures itself.
"""

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx

from bench import report as rep
from bench.workloads import BenchRequest, WorkloadConfig, add_args, from_args, generate, resolve_rates
from gateway.upstream import UPSTREAM_KEEPALIVE_S, Pool, Upstream
from workers.cli_help import HelpFormatter

JSON_HEAD = {"content-type": "application/json"}
T = TypeVar("T")


class Progress:
    """A one-line status on stderr while requests are in the air."""

    def __init__(self, label: str, total: int, duration: float):
        self.label, self.total, self.duration = label, total, duration
        self.sent = self.done = self.errors = 0
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def line(self) -> str:
        el = time.perf_counter() - self.start
        return (
            f"  {self.label}: sent {self.sent}/{self.total}, done {self.done}, errors {self.errors}, "
            f"{el:.0f}/{self.duration:.0f} s"
        )

    async def show(self) -> None:
        while True:
            await asyncio.sleep(0.5 if self.tty else 5.0)
            print(("\r" if self.tty else "") + self.line(), end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(("\r" if self.tty else "") + self.line(), file=sys.stderr, flush=True)


def request_body(
    br: BenchRequest, model: str | None, token_ids: bool, text: Callable[[list[int]], str] | None = None
) -> dict:
    """The completion request for `br`: its token ids as the prompt, or with `text` the
    prompt decoded to text (for routers that take only text, like sglang-router)."""
    body = {
        "prompt": text(br.prompt) if text else br.prompt,
        "max_tokens": br.max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if model:
        body["model"] = model
    if token_ids:
        body["return_token_ids"] = True
    if br.session:
        body["user"] = br.session
    return body


async def send(
    client: Pool,
    url: str,
    br: BenchRequest,
    model: str | None,
    headers: dict,
    token_ids: bool,
    text: Callable[[list[int]], str] | None = None,
    timeout: float = 600.0,
) -> dict:
    """Stream one completion; the record holds client-side timings and the server's usage."""
    rec = {
        "index": br.index,
        "arrival_s": br.arrival_s,
        "prompt_tokens": len(br.prompt),
        "max_tokens": br.max_tokens,
        "output_tokens": 0,
        "cached_tokens": 0,
        "ttft_ms": None,
        "tpot_ms": None,
        "e2e_ms": None,
        "itl_ms": [],
        "worker": None,
        "prefill_worker": None,
        "error": None,
        "session": br.session,
    }
    if br.session:
        headers = {**headers, "x-session-id": br.session}
    body = json.dumps(request_body(br, model, token_ids, text)).encode()
    start = time.perf_counter()
    times: list[float] = []
    usage: dict = {}
    finish = None
    try:
        async with asyncio.timeout(timeout):
            resp = await client.post(url, "/v1/completions", body, {**JSON_HEAD, **headers})
            try:
                rec["worker"] = resp.headers.get("x-kvgate-worker")
                rec["prefill_worker"] = resp.headers.get("x-kvgate-prefill-worker")
                if resp.status != 200:
                    rec["error"] = f"http {resp.status}: {(await resp.read_all())[:300].decode(errors='replace')}"
                    return rec
                usage, finish = await read_events(resp, rec, times)
            finally:
                resp.release()
    except (OSError, TimeoutError, ValueError) as e:  # ConnectionError is an OSError, JSONDecodeError a ValueError
        rec["error"] = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    return finish_record(rec, start, end, times, usage, finish)


async def read_events(resp: Upstream, rec: dict, times: list[float]) -> tuple[dict, str | None]:
    """Read an SSE completion stream to its end (as OpenAI's clients do, so the connection is
    reused): each token's arrival time into `times`; the usage and last finish reason."""
    usage: dict = {}
    finish = None
    rest = b""
    while chunk := await resp.read_some():
        now = time.perf_counter()
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            obj = json.loads(data)
            if "error" in obj:
                rec["error"] = f"stream error: {obj['error'].get('message', obj['error'])}"
                return usage, finish
            usage = obj.get("usage") or usage
            for ch in obj.get("choices") or ():
                n = len(ch.get("token_ids") or ()) or (1 if ch.get("text") else 0)
                times.extend([now] * n)
                finish = ch.get("finish_reason") or finish
    return usage, finish


def finish_record(
    rec: dict, start: float, end: float, times: list[float], usage: dict, finish: str | None = None
) -> dict:
    """Timings and usage into the record. A `length` finish short of max_tokens is an error:
    the server cut the request (context or KV limit), as the simulator counts it; a `stop`
    finish (EOS, where the endpoint ignores ignore_eos) is not."""
    out = usage.get("completion_tokens", len(times))
    rec["output_tokens"] = out
    if finish == "length" and out < rec["max_tokens"] and not rec["error"]:
        rec["error"] = f"cut short: {out} of {rec['max_tokens']} tokens (finish_reason length)"
    rec["prompt_tokens"] = usage.get("prompt_tokens", rec["prompt_tokens"])
    rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if times:
        rec["ttft_ms"] = (times[0] - start) * 1000.0
        rec["e2e_ms"] = (end - start) * 1000.0
        rec["tpot_ms"] = rep.tpot_ms(rec["ttft_ms"], (times[-1] - start) * 1000.0, out)
        rec["itl_ms"] = [(b - a) * 1000.0 for a, b in zip(times, times[1:]) if b > a]
    elif not rec["error"]:
        rec["error"] = "no tokens: the stream ended without output"
    return rec


async def run_rate(
    urls: list[str],
    cfg: WorkloadConfig,
    model: str | None,
    slo: tuple[float, float],
    token_ids: bool = True,
    timeout: float = 600.0,
    text: Callable[[list[int]], str] | None = None,
    pick: Callable[[int, BenchRequest], int] | None = None,
) -> list[dict]:
    """Fire the workload's requests at their arrival times; wait for all; return records.
    With `text`, prompts go as the text it decodes them to. Request `i` goes to
    `urls[pick(i, request)]`, by default to each URL in turn."""
    requests = list(generate(cfg))
    headers = {"x-slo-ttft-ms": str(slo[0]), "x-slo-tpot-ms": str(slo[1])}
    progress = Progress(f"{cfg.rate:g} req/s", len(requests), cfg.duration_s)
    client = Pool(connect_timeout=30.0, keepalive_s=UPSTREAM_KEEPALIVE_S)
    try:

        async def one(i: int, br: BenchRequest) -> dict:
            url = urls[pick(i, br) if pick else i % len(urls)]
            rec = await send(client, url, br, model, headers, token_ids, text, timeout)
            progress.done += 1
            progress.errors += rec["error"] is not None
            return rec

        shower = asyncio.create_task(progress.show())
        loop = asyncio.get_running_loop()
        t0, tasks = loop.time(), []
        for i, br in enumerate(requests):
            delay = t0 + br.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, br)))
            progress.sent += 1
        records = await asyncio.gather(*tasks)
        shower.cancel()
    finally:
        client.close()
    progress.close()
    return list(records)


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on uvloop where it is installed (as the gateway runs), else on
    asyncio's own loop: the client's CPU is taken from the fleet it measures."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def served_model(url: str) -> str | None:
    """The first model the endpoint lists, when the caller did not name one."""
    try:
        data = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        return data[0]["id"] if data else None
    except (httpx.HTTPError, KeyError, ValueError, IndexError):
        return None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate bench serve", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--url",
        action="append",
        required=True,
        help="endpoint base URL (repeat to spread requests round-robin from the client)",
    )
    rate = p.add_mutually_exclusive_group(required=True)
    rate.add_argument("--rate", type=float, help="requests per second (0: a trace at its own timestamps)")
    rate.add_argument(
        "--sweep", help="R1,R2,...: one run per rate; goodput (the highest rate meeting the SLOs) from the sweep"
    )
    add_args(p)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="a request meets its SLO within this TTFT ...")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="... and this time per output token")
    p.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    p.add_argument("--label", help="name of this target in the report (default: the URL)")
    p.add_argument(
        "--no-token-ids",
        action="store_true",
        help="do not ask for return_token_ids (for endpoints that reject it; tokens are then counted per chunk)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--title", help="plot title")
    p.add_argument("--out", required=True, help="report JSON; plots are written next to it")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        asked = argv[:1] in (["-h"], ["--help"])
        print(
            "usage: kvgate bench serve --url URL (--rate R | --sweep R1,R2,...) --out REPORT.json ... "
            "(kvgate bench serve --help lists every flag)",
            file=sys.stdout if asked else sys.stderr,
        )
        sys.exit(0 if asked else 2)
    args = parser().parse_args(argv[1:])
    urls = [u.rstrip("/") for u in args.url]
    rates = resolve_rates(
        args, [args.rate] if args.rate is not None else sorted(float(r) for r in args.sweep.split(","))
    )
    model = args.model or served_model(urls[0])
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    label = args.label or (urls[0] if len(urls) == 1 else f"{len(urls)} urls, client round-robin")
    t0 = time.perf_counter()
    runs = []
    for rate in rates:
        records = run_loop(run_rate(urls, from_args(args, rate), model, slo, not args.no_token_ids, args.timeout))
        run = rep.summarize(records, *slo)
        run.update(rate_rps=rate, records=records)
        runs.append(run)
        print(f"  {rate:g} req/s: {rep.run_line(run)}", file=sys.stderr, flush=True)
    meta = {
        "kind": "bench-serve",
        "title": args.title or f"{args.workload} against {label}",
        "command": "kvgate bench " + " ".join(argv),
        "urls": urls,
        "model": model,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "workload": {k: v for k, v in vars(from_args(args, 0.0)).items() if k != "rate"},
        "wall_s": time.perf_counter() - t0,
    }
    rep.publish({label: runs}, meta, args.out)
