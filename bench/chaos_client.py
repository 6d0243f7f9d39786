"""The client side of the chaos runs: send requests, and judge every answer strictly.

Each request ends as exactly one outcome:

- `ok`: a whole answer (a finish reason; a stream ends with `[DONE]`);
- `refused`: 429 or 503 with an OpenAI error object and a `Retry-After` header (load shedding);
- `clean_error`: any other status with an OpenAI error object, or a stream that ends with an
  SSE error event and `[DONE]` (a worker died after the stream was committed); one that came
  before any answer reached the client (`uncommitted`) is a failure the gateway could have
  retried;
- `dirty`: anything a client cannot handle cleanly: a reset or dropped connection, a body
  that is not an OpenAI error, a stream cut off without `[DONE]`;
- `lost`: no answer within the client's timeout.
"""

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass

import aiohttp

OK, REFUSED, CLEAN, DIRTY, LOST = "ok", "refused", "clean_error", "dirty", "lost"
OUTCOMES = (OK, REFUSED, CLEAN, DIRTY, LOST)
MODEL = "smollm2-135m"


@dataclass
class Outcome:
    start_s: float
    end_s: float
    stream: bool
    result: str
    status: int | None = None
    ttft_ms: float | None = None
    detail: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def latency_ms(self) -> float:
        return (self.end_s - self.start_s) * 1000.0


@dataclass(frozen=True)
class Shape:
    """What requests look like: prompt token ids and output length ranges, the share streamed."""

    prompt: tuple[int, int] = (8, 64)
    output: tuple[int, int] = (4, 24)
    stream_share: float = 0.5
    prefixes: int = 8


def body(rng: random.Random, shape: Shape) -> dict:
    """A completion request as token ids (cheap to make), sharing one of a few prefixes."""
    prefix = [1000 + rng.randrange(shape.prefixes)] * 16
    prompt = prefix + [rng.randrange(2000, 30000) for _ in range(rng.randint(*shape.prompt))]
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": rng.randint(*shape.output),
        "ignore_eos": True,
        "stream": rng.random() < shape.stream_share,
        "temperature": 0.0,
    }


def judge_error(status: int, headers, raw: bytes) -> tuple[str, str]:
    """(outcome, detail) of a non-200 answer."""
    try:
        err = json.loads(raw)["error"]
        shaped = isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err
    except (ValueError, KeyError, TypeError):
        shaped, err = False, {}
    if not shaped:
        return DIRTY, f"{status} without an OpenAI error: {raw[:120]!r}"
    if status in (429, 503):
        retry = headers.get("retry-after", "")
        return (REFUSED if retry.isdigit() else DIRTY), f"{status} {err.get('code')} retry-after={retry!r}"
    return CLEAN, f"{status} {err.get('code')}"


def judge_stream(lines: list[str]) -> tuple[str, str]:
    """(outcome, detail) of a 200 stream's data lines."""
    if not lines or lines[-1] != "[DONE]":
        return DIRTY, "the stream ended without [DONE]"
    events = [json.loads(ln) for ln in lines[:-1]]
    if events and "error" in events[-1]:
        tokens = sum(
            bool(c.get("text") or c.get("delta", {}).get("content"))
            for e in events[:-1]
            for c in e.get("choices") or ()
        )
        return CLEAN, f"stream error {events[-1]['error'].get('code')} after {tokens} tokens"
    finishes = [c.get("finish_reason") for e in events for c in e.get("choices") or ()]
    return (OK, "") if any(finishes) else (DIRTY, "the stream ended without a finish reason")


async def send(
    session: aiohttp.ClientSession, url: str, req: dict, t0: float, timeout: float, start: float | None = None
) -> Outcome:
    """One request, judged. Latency counts from `start` (its intended send time, so a client
    that falls behind shows it) or from now."""
    start = time.monotonic() if start is None else start
    out = Outcome(start - t0, 0.0, req["stream"], DIRTY)
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url + "/v1/completions", json=req) as r:
                out.status = r.status
                if r.status != 200:
                    out.result, out.detail = judge_error(r.status, r.headers, await r.read())
                elif req["stream"]:
                    lines = []
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if line.startswith("data: "):
                            if out.ttft_ms is None:
                                out.ttft_ms = (time.monotonic() - start) * 1000.0
                            lines.append(line[6:])
                    out.result, out.detail = judge_stream(lines)
                else:
                    choices = json.loads(await r.read()).get("choices") or [{}]
                    ok = choices[0].get("finish_reason") in ("length", "stop")
                    out.result, out.detail = (OK, "") if ok else (DIRTY, "no finish reason")
                    out.ttft_ms = (time.monotonic() - start) * 1000.0
    except TimeoutError:
        out.result, out.detail = LOST, f"no answer within {timeout:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        out.result, out.detail = DIRTY, f"{type(e).__name__}: {e}"
    out.end_s = time.monotonic() - t0
    return out


def session() -> aiohttp.ClientSession:
    """aiohttp, not httpx: with thousands of connections open under overload httpx's pool
    becomes the bottleneck (connect timeouts that are the client's, not the server's)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0)
    )


async def closed_loop(
    url: str, n: int, concurrency: int, shape: Shape, seed: int, t0: float, timeout: float = 60.0
) -> list[Outcome]:
    """`n` requests, `concurrency` at a time, each sent as soon as a slot is free."""
    rng = random.Random(seed)
    reqs = [body(rng, shape) for _ in range(n)]
    outcomes: list[Outcome] = []
    async with session() as s:

        async def lane() -> None:
            while reqs:
                outcomes.append(await send(s, url, reqs.pop(), t0, timeout))

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return outcomes


async def open_loop(
    url: str, rate: float, duration_s: float, shape: Shape, seed: int, t0: float, timeout: float = 60.0
) -> list[Outcome]:
    """Poisson arrivals at `rate` per second for `duration_s`, each sent whatever the earlier
    ones are doing (a slow server faces a growing queue, as under real overload)."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    begin, at, tasks = time.monotonic(), 0.0, []
    async with session() as s:
        while at < duration_s:
            delay = begin + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(send(s, url, body(rng, shape), t0, timeout, begin + at)))
            at += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


def uncommitted(o: Outcome) -> bool:
    """A clean error the client got before any token: not a stream cut after it had started."""
    return o.result == CLEAN and not (o.stream and " after " in o.detail and " after 0 tokens" not in o.detail)


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    return {k: sum(o.result == k for o in outcomes) for k in OUTCOMES}


def per_second(outcomes: list[Outcome], span_s: float) -> dict[str, list[int]]:
    """Outcomes by the second they ended in: the timeline's series."""
    n = int(span_s) + 1
    series = {k: [0] * n for k in OUTCOMES}
    for o in outcomes:
        series[o.result][min(n - 1, int(o.end_s))] += 1
    return series
