"""What Starlette's stack costs the gateway per proxied request (issue 16 point 6): the
gateway's own ASGI app (`Gateway.app`: Starlette's error and exception middlewares, CloseOn5xx,
Guard, the router, the route's request/response wrapper) around a stub handler that reads the
body and answers, against the same stub behind CloseOn5xx and Guard only, and the stub alone
(a `Request` built, a `Response` sent), in one process on an in-memory ASGI call. The difference
is what a leaner front for the two hot routes could save; compare it with a request's CPU in
`bench.vs_peers`' low-load run (~5-6 ms). JSON and PNG.

    PYTHONPATH=. python experiments/asgi_stack.py --out F.json
"""

import argparse
import asyncio
import json
import statistics
import time

from starlette.requests import Request
from starlette.responses import Response

from gateway.app import Gateway
from gateway.auth import Guard
from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.tokenize import Tokenizers
from policies.registry import load_policy
from workers.http_guard import CloseOn5xx

BODY = json.dumps({"model": "m", "prompt": "hello " * 256, "max_tokens": 16, "stream": True}).encode()


def scope() -> dict:
    """A POST /v1/completions as uvicorn hands it to the app."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(BODY)),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
        "extensions": {},
    }


async def receive() -> dict:
    return {"type": "http.request", "body": BODY, "more_body": False}


async def send(message: dict) -> None:
    pass


def stacks() -> dict:
    """The three ASGI apps compared, each ending in the same stub handler."""
    gateway = Gateway(Fleet(ResidencyIndex()), Tokenizers(16), load_policy("slo_goodput"))

    async def handle(request: Request, kind: str) -> Response:
        await request.body()
        resp = Response(b"{}", 200, gateway.headers("w0", 0), media_type="application/json")
        resp.headers["x-request-id"] = resp.headers["x-kvgate-request-id"] = "cmpl-0"
        return resp

    gateway.handle = handle  # type: ignore[method-assign]

    async def endpoint(scope, receive, send) -> None:
        resp = await handle(Request(scope, receive), "completion")
        await resp(scope, receive, send)

    return {
        "gateway app (starlette)": gateway.app,
        "CloseOn5xx + Guard": CloseOn5xx(Guard(endpoint, gateway.access)),
        "handler alone": endpoint,
    }


async def per_call_us(app, n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        await app(scope(), receive, send)
    return (time.process_time() - t0) / n * 1e6


async def measure(n: int, rounds: int) -> dict[str, list[float]]:
    apps = stacks()
    for app in apps.values():
        await per_call_us(app, 200)  # Starlette builds its middleware stack on the first call
    out: dict[str, list[float]] = {name: [] for name in apps}
    for _ in range(rounds):
        for name, app in apps.items():
            out[name].append(await per_call_us(app, n))
    return out


def plot(medians: dict[str, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(list(medians), list(medians.values()))
    ax.set_xlabel("CPU us per request (median of rounds)")
    ax.set_title("The gateway's ASGI stack around a stub handler")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5000, help="calls per app per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    runs = asyncio.run(measure(a.requests, a.rounds))
    medians = {name: statistics.median(us) for name, us in runs.items()}
    report = {
        "command": "experiments/asgi_stack.py",
        "requests_per_round": a.requests,
        "us_per_request": runs,
        "median_us": medians,
        "starlette_over_middlewares_us": medians["gateway app (starlette)"] - medians["CloseOn5xx + Guard"],
    }
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(medians, a.out.removesuffix(".json") + ".png")
    for name, us in medians.items():
        print(f"{name}: {us:.1f} us")


if __name__ == "__main__":
    main()
