"""The worker's internal control endpoints, which the gateway and tools read with the fleet's
internal token: `/state` (load and liveness), `/steps` (the step log calibration fits),
`/kv/events` (a long poll, or with `stream=1` an NDJSON stream), `/kv/snapshot` and
`/kv/reset`. Split from the OpenAI surface (workers/server.py), which they share only the
engine, the transfer service and the drain flag with."""

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.http_guard import error

if TYPE_CHECKING:
    from workers.server import WorkerServer

LONG_POLL_SLICE_S = 0.5  # a /kv/events long poll looks at the drain flag this often
MAX_WAIT_S = 30.0  # the longest /kv/events wait (`timeout`) a request gets
MIN_HEARTBEAT_S = 0.05  # the shortest heartbeat of a /kv/events stream


class ControlRoutes:
    """The internal endpoints of one worker server (`server`: its engine, transfer service,
    drain flag and in-flight count)."""

    def __init__(self, server: "WorkerServer"):
        self.server = server
        self.engine = server.engine
        self.transfer = server.transfer
        self._kv_changed: asyncio.Event | None = None

    def routes(self) -> list[Route]:
        return [
            Route("/state", self.state),
            Route("/steps", self.steps),
            Route("/kv/events", self.kv_events),
            Route("/kv/snapshot", self.kv_snapshot),
            Route("/kv/reset", self.kv_reset, methods=["POST"]),
        ]

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake `/kv/events` waiters on `loop` at each batch the engine publishes."""
        changed = self._kv_changed = asyncio.Event()
        self.engine.events.subscribe(lambda events: loop.call_soon_threadsafe(changed.set))

    def _refused(self, request: Request) -> Response | None:
        """403 for an internal read without the token, when this worker has one (the gateway
        and tools send it; workers/internal_auth.py says why)."""
        if self.transfer.token and not self.transfer.authorised(request):
            return error(
                403,
                f"{request.url.path} is internal: it needs the fleet's internal token",
                "permission_error",
                "forbidden",
            )
        return None

    async def state(self, request: Request) -> Response:
        """Load as of the last step, plus liveness now: whether the engine thread runs, how long
        it has gone without completing a step while it has work, and whether the worker drains."""
        if refused := self._refused(request):
            return refused
        return JSONResponse(self.state_body())

    def state_body(self) -> dict:
        """The /state body (also what rides on a `/kv/events?state=1` answer)."""
        return {
            **self.engine.state().to_json(),
            "kv_transfer": self.transfer.stats(),
            "engine_alive": self.engine.alive,
            "engine_stall_s": self.engine.stall_s(),
            "draining": self.server.draining,
            "in_flight": self.server.in_flight,
        }

    async def steps(self, request: Request) -> Response:
        """The engine's step log after step `after`: each step's number, times and work
        (`StepRecord.to_json`)."""
        if refused := self._refused(request):
            return refused
        try:
            after = int(request.query_params.get("after", "0"))
        except ValueError:
            return error(400, "'after' must be an integer")
        last, steps = await asyncio.wrap_future(self.engine.step_log(after))
        return JSONResponse({"last": last, "steps": steps})

    async def kv_events(self, request: Request) -> Response:
        """KV events after `after`, waiting up to `timeout` seconds for one (not while draining);
        with `state=1` the answer carries the /state body as of its sending, so a gateway tailing
        the events needs no separate /state poll while the answers keep coming (gateway/fleet.py).
        With `stream=1` the answers go on as NDJSON lines on one response, each sent as soon as
        there are events or `timeout` seconds passed without any, until the worker drains or
        the client leaves: a long poll per batch cost the gateway an HTTP exchange per engine
        step per worker, most of its control-plane CPU under load. With `delta=1` too, a stream's
        line carries only the state's fields that changed since its previous line (the first
        line all of them): the cost model alone was 1.5 of a line's 2.5 kB, parsed by the
        gateway twice a request."""
        if refused := self._refused(request):
            return refused
        query = events_query(request)
        if isinstance(query, Response):
            return query
        after, timeout = query
        with_state = request.query_params.get("state") == "1"
        if request.query_params.get("stream") == "1":
            if timeout < MIN_HEARTBEAT_S:
                return error(
                    400,
                    f"a stream of KV events needs a 'timeout' (its heartbeat) of at least {MIN_HEARTBEAT_S} s",
                    param="timeout",
                )
            delta = with_state and request.query_params.get("delta") == "1"
            lines = self._event_lines(after, timeout, with_state, delta)
            return StreamingResponse(lines, media_type="application/x-ndjson")
        await self._wait_events(after, timeout)
        return JSONResponse(self._events_body(after, with_state))

    async def _wait_events(self, after: int, timeout: float) -> None:
        """Until an event past `after` is logged, `timeout` seconds pass or the worker drains."""
        events, changed = self.engine.events, self._kv_changed
        assert changed is not None, "ControlRoutes.start runs in the server's lifespan"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while events.last_seq <= after and not self.server.draining and loop.time() < deadline:
            changed.clear()
            if events.last_seq > after:
                break
            try:  # in slices: a draining worker's long polls end at once and do not hold up its exit
                await asyncio.wait_for(changed.wait(), min(deadline - loop.time(), LONG_POLL_SLICE_S))
            except asyncio.TimeoutError:
                pass

    def _events_body(self, after: int, with_state: bool) -> dict:
        body = self.engine.events.after(after).to_json()
        if with_state:
            body["state"] = self.state_body()
        return body

    async def _event_lines(self, after: int, timeout: float, with_state: bool, delta: bool) -> AsyncIterator[bytes]:
        """The `stream=1` answers: one JSON line per batch (or heartbeat), until draining; with
        `delta`, each line's state only what changed since the line before (`state_changes`).
        The first line goes at once: its state stands the gateway's poller down from the
        stream's start, where an idle worker's first line came a heartbeat (5 s) later, and the
        gateway polled its /state twice a second until then."""
        sent: dict = {}
        while True:
            body = self._events_body(after, with_state)
            if delta:
                sent, body["state"] = body["state"], state_changes(body["state"], sent)
            yield json.dumps(body, separators=(",", ":")).encode() + b"\n"
            if self.server.draining:
                return
            if body["events"]:
                after = body["events"][-1]["seq"]
            elif body["gap"]:  # the client resyncs from a snapshot; do not repeat the gap
                after = body["last_seq"]
            await asyncio.sleep(0)  # a line per step of a busy engine must not keep the loop from others
            await self._wait_events(after, timeout)

    async def kv_reset(self, request: Request) -> Response:
        """Drop every cached-but-free block (after a weight reload); internal, token-protected."""
        if not self.transfer.authorised(request):
            return error(
                403, "resetting the prefix cache needs the fleet's internal token", "permission_error", "forbidden"
            )
        evicted = await asyncio.wrap_future(self.engine.clear_cache())
        return JSONResponse({"evicted": evicted})

    async def kv_snapshot(self, request: Request) -> Response:
        if refused := self._refused(request):
            return refused
        snap = await asyncio.wrap_future(self.engine.kv_snapshot())
        return JSONResponse(snap.to_json() | {"block_size": self.engine.config.block_size})


def events_query(request: Request) -> tuple[int, float] | Response:
    """(`after`, `timeout`) of a /kv/events request, the wait at most MAX_WAIT_S, or the 400
    refusing them. The timeout must be finite: NaN passed every bound, and a stream whose
    waits all ended at once sent line after line without letting the event loop run anything else."""
    try:
        after = int(request.query_params.get("after", "0"))
        timeout = float(request.query_params.get("timeout", "0"))
    except ValueError:
        return error(400, "'after' must be an integer and 'timeout' a number of seconds")
    if not math.isfinite(timeout):
        return error(400, "'timeout' must be a finite number of seconds", param="timeout")
    return after, min(timeout, MAX_WAIT_S)


def state_changes(state: dict, before: dict) -> dict:
    """The fields of `state` that `before` lacks or holds another value of: what a reader that
    has `before` needs to have `state` (a state's fields are fixed, none goes away)."""
    return {k: v for k, v in state.items() if k not in before or before[k] != v}
