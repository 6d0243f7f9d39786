"""The gateway's prefill leg runs in the background: its caller's `done` is called exactly once
however it ends, so the prefill worker's in-flight count always closes."""

import asyncio

from gateway import pd


class RaisingProxy:
    async def open(self, *args, **kw):
        raise ValueError("a bug, not a connection failure")


class HangingProxy:
    async def open(self, *args, **kw):
        await asyncio.sleep(3600)


def test_done_is_called_when_the_leg_raises_or_is_cancelled():
    async def main() -> list:
        got: list = []
        raised = pd.start_prefill(RaisingProxy(), "http://p", "/v1/completions", b"{}", {}, got.append)
        hung = pd.start_prefill(HangingProxy(), "http://q", "/v1/completions", b"{}", {}, got.append)
        await asyncio.sleep(0.01)
        hung.cancel()
        await asyncio.gather(raised, hung, return_exceptions=True)
        await asyncio.sleep(0)
        return got

    assert asyncio.run(main()) == [None, None]
