"""A request's outputs between the engine's deliveries and its reader (vLLM v1's
RequestOutputCollector, per choice): a reader that lags gets one merged output per choice."""

import asyncio
from collections import OrderedDict

from workers.outputs import RequestOutput


class RequestOutputCollector:
    """Each choice's outputs not yet read, merged into one (`RequestOutput.add`): a reader that
    lags (its client reads the stream slowly) is sent one chunk per choice for what piled up,
    and memory holds only that text and those tokens, never an object per token per choice.

    `get` returns the choices in the order their pending output arrived, except that a choice's
    last output (finish_reason set) takes its place in arrival order: choices are read ending
    in the order they ended, so the first failed choice read is the first that failed. The
    collector takes each output put: the engine builds every output afresh for one sink."""

    def __init__(self) -> None:
        self._pending: OrderedDict[int, RequestOutput] = OrderedDict()
        self._ready = asyncio.Event()

    def put(self, i: int, out: RequestOutput) -> None:
        """Choice `i`'s next output, merged into its output not yet read if there is one."""
        held = self._pending.get(i)
        if held is None:
            self._pending[i] = out
            self._ready.set()
            return
        held.add(out)
        if out.finish_reason is not None:
            self._pending.move_to_end(i)

    async def get(self) -> tuple[int, RequestOutput]:
        """The next choice with an output pending, and that output (all it produced since it
        was last read); waits for one. Cancelling the wait loses nothing."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        return self._pending.popitem(last=False)
