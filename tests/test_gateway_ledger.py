"""The gateway's ledger of what it has in flight at each worker (policies/ledger.py), kept on
the request path: entered when the request is decided, started at its first streamed token,
left when it ends, whatever way it ends. A real sim worker behind a gateway served in this
process (its own HTTP server on a free port), so the test can read the ledger."""

import asyncio
import signal

import httpx

from gateway.cli_args import parser
from gateway.procs import free_port, start_worker
from gateway.server import build, http_server
from workers.listen import listen

PROMPT = "the ledger counts what each worker holds " * 8


async def until(check, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_request_is_in_its_workers_ledger_while_in_flight():
    w = start_worker("ledger0").ready()
    try:
        port = free_port()
        args = parser().parse_args(
            ["--worker", w.url, "--policy", "slo_goodput", "--model", "smollm2-135m", "--port", str(port)]
        )
        gw = build(args)
        server = http_server(gw, args)

        async def go() -> dict:
            seen: dict = {}
            serving = asyncio.create_task(server.serve(sockets=[listen("127.0.0.1", port, "test gateway")]))
            try:
                await until(lambda: gw.fleet.by_id("ledger0") is not None and gw.fleet.by_id("ledger0").available)
                led = gw.fleet.by_id("ledger0").ledger
                start = led.start

                def started(request_id: str, at: float) -> None:  # what it holds at the first token
                    start(request_id, at)
                    seen["streaming"] = [(e.need, e.max_tokens, e.started_at is not None) for e in led.sent.values()]

                led.start = started  # type: ignore[method-assign]
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                    body = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 48, "stream": True}
                    async with c.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as r:
                        assert r.status_code == 200
                        seen["rest"] = [line async for line in r.aiter_lines() if line.startswith("data:")]
                    seen["after_stream"] = len(led)
                    r2 = await c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 4})
                    seen["whole"] = (r2.status_code, len(led))
                    r3 = await c.post("/v1/completions", json={**body, "max_tokens": 10**9})
                    seen["refused"] = (r3.status_code, len(led))
            finally:
                server.handle_exit(signal.SIGTERM, None)  # drains (nothing left) and exits
                await serving
            return seen

        seen = asyncio.run(go())
    finally:
        w.stop()
    [(need, max_tokens, started)] = seen["streaming"]
    assert max_tokens == 48 and started
    assert need >= (64 + 48) // 16  # at least the prompt's words and the answer, in 16-token blocks
    assert seen["rest"][-1] == "data: [DONE]"
    assert seen["after_stream"] == 0
    assert seen["whole"] == (200, 0)
    assert seen["refused"][0] == 400 and seen["refused"][1] == 0
