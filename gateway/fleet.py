"""The worker registry: who is up and how loaded; in embedded mode it starts each worker's KV-event tail.

Each worker gets two background tasks. The poller GETs `/state` whenever the worker's state is
`interval` seconds old and is the health check: one failed poll (refused, or no answer within
`timeout`) takes the worker out of the candidate set and drops its residency, so a dead
worker is gone within `interval + timeout` (< 2 s by default); the next good poll brings it
back. The tail's `/kv/events` answers carry the worker's state too, so while they come the
poller has nothing to do; an idle worker (nothing waiting or running, nothing sent to it
since) is polled only once its long poll is overdue. That was most of the gateway's idle CPU:
now one request per worker per 5 s long poll instead of two polls a second. A dead idle worker
breaks its long poll at once; a frozen one, which nothing is sent to, is out after the long
poll's timeout (~6 s); one that is sent a request is polled within the interval again. A worker that
answers is still out of service while its state says its engine thread is not running, it
is draining, or its engine has made no progress on its work for more than `stall_s` seconds
(a frozen engine behind a live HTTP server); a worker reporting a stall is polled again as
its stall would pass `stall_s`, so a frozen engine is out at about `stall_s` plus one poll's
round trip (< 2 s by default). The poller's wait is moved whenever what it waits for changes
(a state arrives, a request is sent or ends), so it wakes only when a poll is due: a busy
worker whose KV-event lines carry its state is not polled, nor is its poller woken. Losing a
worker resolves its `lost` future, so requests waiting on it give up at once and are retried
elsewhere. The tail (gateway.kv_tail) follows each worker's KV events into the residency
index and hands the state riding on them to `up`, as a poll's; while Redis carries a worker's
events (see redis_state) its tail idles. Routing reads only in-memory fields, never the
network. Polls and snapshots use aiohttp. A state is another process's bytes: one that is not
a state (`WorkerState.from_json`) fails its poll; a task that fails of anything unforeseen is
logged and started again, its worker down meanwhile.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial

import aiohttp

from gateway.breaker import Breaker, BreakerConfig
from gateway.control import Refused, check
from gateway.index import ResidencyIndex
from gateway.kv_tail import LONG_POLL_S, KvTail
from gateway.shared_ledger import ENDED, ROUTED, SENT, STARTED, TALLY, LedgerNote
from gateway.upstream import UPSTREAM_KEEPALIVE_S, Pool
from gateway.worker import DRAINING, KVGATE, Worker, idle, less_held, out_of_service
from gateway.worker_view import view_of_state, with_fields
from policies.api import DEFAULT_TIER_CREDITS, Tally, TierCredits, WorkerView
from policies.ledger import Sent
from workers.generation_defaults import NEUTRAL, GenerationDefaults
from workers.internal_auth import internal_headers
from workers.kv.worker_state import WorkerState

log = logging.getLogger("kvgate.gateway")

STALL_POLL_MARGIN_S = 0.05


def _settle(f: asyncio.Future) -> None:
    if not f.done():
        f.set_result(None)


class Fleet:
    """`token`: the fleet's internal token, sent on every control-plane call (workers refuse
    /state, /kv/events and /kv/snapshot without it when they have one). `kinds`: worker kinds
    other than kvgate's own, by name (gateway/vllm_worker.py). `tier_credits`: what a matched
    block in a worker's host or disk tier is worth to the policies, and the tier rates for workers
    that do not publish their own (policies.api.TierCredits, `tier_rates`)."""

    def __init__(
        self,
        index: ResidencyIndex,
        interval: float = 0.5,
        timeout: float = 1.0,
        stall_s: float = 1.5,
        breaker: BreakerConfig | None = None,
        token: str | None = None,
        kinds: dict | None = None,
        tier_credits: TierCredits = DEFAULT_TIER_CREDITS,
    ):
        self.index = index
        self.tier_credits = tier_credits
        self.token = token
        self.kinds = kinds or {}
        self.interval = interval
        self.timeout = timeout
        self.stall_s = stall_s
        self.breaker = breaker or BreakerConfig()
        self.workers: dict[str, Worker] = {}
        self.session: aiohttp.ClientSession | None = None
        self.streams = Pool(connect_timeout=timeout, keepalive_s=UPSTREAM_KEEPALIVE_S)
        self.tail = KvTail(self)
        self._started = False
        self.on_change: Callable[[Worker, int], None] | None = None  # in-flight +1/-1, for sharing
        self.on_ledger: Callable[[LedgerNote], None] | None = None  # ledger changes, for sharing

    def add(self, url: str, static: bool = True, kind: str = KVGATE) -> Worker:
        url = url.rstrip("/")
        w = self.workers.get(url)
        if w is None:
            w = self.workers[url] = Worker(
                url, static, breaker=Breaker(self.breaker), kind=kind if kind in self.kinds else KVGATE
            )
            if self._started:
                self._spawn(w)
        return w

    def remove(self, url: str) -> None:
        w = self.workers.pop(url.rstrip("/"), None)
        if w is not None:
            for t in w.tasks:
                t.cancel()
            self.down(w, "removed from the registry")

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
            headers=self.headers,
        )
        self._started = True
        for w in self.workers.values():
            self._spawn(w)

    async def stop(self) -> None:
        self._started = False
        tasks = [t for w in self.workers.values() for t in w.tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.streams.close()
        if self.session is not None:
            await self.session.close()

    @property
    def headers(self) -> dict[str, str]:
        """What every control-plane call sends: the internal token, if any."""
        return internal_headers(self.token)

    def _spawn(self, w: Worker) -> None:
        if w.kind in self.kinds:
            w.tasks = self.kinds[w.kind].spawn(self, w)
        else:
            w.tasks = [asyncio.create_task(self._poll(w)), asyncio.create_task(self.tail.run(w))]
        for t in w.tasks:
            t.add_done_callback(partial(self._ended, w))

    def _ended(self, w: Worker, task: asyncio.Task) -> None:
        """One of `w`'s tasks ended, which only cancelling should make them do. One that failed,
        of something unforeseen, is logged, `w` taken down and its tasks started anew an
        interval later: a task that died left its worker's health or residency frozen for good."""
        if task.cancelled() or task not in w.tasks or self.workers.get(w.url) is not w:
            return
        e = task.exception()
        log.error("a task of the worker at %s ended (%r); its tasks start again", w.url, e, exc_info=e)
        for t in w.tasks:
            t.cancel()
        w.tasks = []
        self.down(w, f"a task of it ended: {e!r}")
        asyncio.get_running_loop().call_later(self.interval, self._respawn, w)

    def _respawn(self, w: Worker) -> None:
        if self._started and not w.tasks and self.workers.get(w.url) is w:
            self._spawn(w)

    # health and load

    async def _poll(self, w: Worker) -> None:
        while True:
            wait = self.poll_wait_s(w)
            if wait > 0.0:
                await self._nap(w, wait)
                continue
            w.tried = time.monotonic()
            try:
                self.up(w, await self.get(w.url + "/state", self.timeout))
            except Refused as e:
                if not w.refused:
                    log.error("%s", e)
                w.refused = True
                self.down(w, str(e))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
                w.probe_failures += 1
                self.down(w, f"/state failed: {e!r}")

    async def _nap(self, w: Worker, seconds: float) -> None:
        """Wait `seconds` for `w`'s next poll, or less or more as `_rearm` moves it. Waking each
        interval to check was a third of an idle gateway's CPU; waking when a wait set before a
        KV-event line, a request's start or its end ran out was about one wakeup a request."""
        loop = asyncio.get_running_loop()
        nap = w.nap = loop.create_future()
        w.nap_timer = loop.call_later(seconds, _settle, nap)
        try:
            await nap
        finally:
            if w.nap_timer is not None:
                w.nap_timer.cancel()
            w.nap, w.nap_timer = None, None

    def _rearm(self, w: Worker) -> None:
        """Move `w`'s poller's wait to when its next poll is due now: after a state came, a
        request was sent to it or one ended, which is when that changes. So a busy worker whose
        KV-event lines carry its state, or that turns idle before its poll, is not polled (nor
        its poller woken), while one that falls silent is polled as before."""
        if w.nap is None or w.nap.done():
            return
        assert w.nap_timer is not None, "a nap has its timer"
        w.nap_timer.cancel()
        wait = self.poll_wait_s(w)
        if wait > 0.0:
            w.nap_timer = asyncio.get_running_loop().call_later(wait, _settle, w.nap)
        else:
            w.nap_timer = None
            _settle(w.nap)

    def poll_wait_s(self, w: Worker) -> float:
        """Seconds until `w`'s next poll: `next_poll_s` from its last state, its last poll tried,
        or the request that ended its idleness (a poll an interval after it, unless its KV-event
        lines say how it is first), whichever is latest."""
        return self.next_poll_s(w, time.monotonic() - max(w.state_at, w.tried, w.woken_at))

    def next_poll_s(self, w: Worker, age: float) -> float:
        """Seconds until `w`'s next poll, `age` seconds after its last state came (or its last
        poll was tried): the rest of the interval; for an idle worker whose KV-event answers
        carry its state, the rest of a long poll and its timeout (those answers come at least
        that often); less when its engine's stall would pass `stall_s` before then, so a frozen
        engine is out at `stall_s` plus a poll, not plus a whole interval."""
        period = self.interval
        if w.state_rides and idle(w):
            period = max(period, LONG_POLL_S + self.timeout)
        wait = period - age
        stall = (w.state.get("engine_stall_s") or 0.0) if w.healthy and w.out is None else 0.0
        if stall > 0.0:
            wait = min(wait, self.stall_s - stall + STALL_POLL_MARGIN_S)
        return max(0.0, wait)

    async def get(self, url: str, timeout: float, params: dict | None = None) -> dict:
        """GET a JSON body; raises aiohttp.ClientError for refusals and error statuses,
        asyncio.TimeoutError past `timeout` seconds, ValueError for a body that is not JSON (or
        nests past the parser's recursion limit)."""
        assert self.session is not None, "Fleet.start opens the session before any poll"
        async with self.session.get(url, params=params, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            check(r)
            try:
                return await r.json(content_type=None)
            except RecursionError:
                raise ValueError(f"{url} answered JSON nested too deep to parse") from None

    def up(self, w: Worker, state: dict) -> None:
        """`w` answered with `state` (a poll, a KV-event line, another kind's link): it is up,
        in service unless `out_of_service` says why not, its view rebuilt from `state`. Raises
        ValueError, having changed nothing, for a state that is not one (`WorkerState.from_json`
        names the field): its fields are read on every request, a bad one must not fail them."""
        parsed = WorkerState.from_json(state, w.state)
        wid = parsed.worker_id
        cost = w.base.cost if w.base is not None and parsed.cost_model == w.state.get("cost_model") else None
        view = view_of_state(state, w.url, self.tier_credits, cost, parsed)
        if w.worker_id not in ("", wid):
            self.index.drop(w.worker_id)
        if not w.healthy:
            log.info("worker %s at %s is up", wid, w.url)
            w.breaker.reset()
        out = out_of_service(state, self.stall_s)
        if out != w.out:
            if out is None:
                log.info("worker %s at %s is back in service", wid, w.url)
            else:
                log.warning("worker %s at %s is out of service: %s", wid, w.url, out)
                if out != DRAINING:
                    self._lose(w, out)
        defaults = state.get("generation_defaults")
        if defaults is not w.state.get("generation_defaults"):
            w.generation_defaults = NEUTRAL if defaults is None else GenerationDefaults.from_json(defaults)
        w.worker_id, w.state, w.healthy, w.suspect, w.out = wid, state, True, False, out
        w.sent_since_poll = w.done_since_poll = 0
        w.state_at = time.monotonic()
        w.base = with_fields(view, residency_epoch=self.index.epoch(wid), ledger=w.ledger)
        self._rearm(w)

    def down(self, w: Worker, why: str) -> None:
        """`w` did not answer: out of the candidates, its residency dropped, requests waiting
        on it released (`lost`), its answers in transit stale (a new epoch)."""
        if w.healthy:
            log.warning("worker %s at %s is down: %s", w.worker_id, w.url, why)
        w.healthy = False
        w.epoch += 1
        self._lose(w, why)
        if w.worker_id:
            self.index.drop(w.worker_id)
        self._rearm(w)  # an idle worker's long wait ends: it is polled as a down worker is

    def lost(self, w: Worker) -> asyncio.Future:
        """A future resolved (with the reason) when `w` is next taken out of service."""
        if w.lost is None:
            w.lost = asyncio.get_running_loop().create_future()
        return w.lost

    def _lose(self, w: Worker, why: str) -> None:
        if w.lost is not None:
            if not w.lost.done():
                w.lost.set_result(why)
            w.lost = None

    def mark_suspect(self, w: Worker, why: str) -> None:
        """Exclude a worker that just failed a request until its next good health poll."""
        if not w.suspect:
            log.warning("worker %s at %s is suspect: %s", w.worker_id, w.url, why)
        w.suspect = True

    # views for routing

    def by_id(self, worker_id: str) -> Worker | None:
        for w in self.workers.values():
            if w.worker_id == worker_id:
                return w
        return None

    def candidates(self, model: str | None) -> list[Worker]:
        return [w for w in self.workers.values() if w.available and (model is None or w.model == model)]

    def views(
        self, workers: list[Worker], matches: dict[str, int], slow: dict[str, tuple[int, int]] | None = None
    ) -> tuple[WorkerView, ...]:
        """The policy's picture of `workers`: last polled load less what has ended since,
        matched prefix (with `slow`, the index's `slow_blocks`: how much of it is in host and
        disk tiers), in-flight, and the blocks the index holds for it (live, where a poll is up
        to `interval` old)."""
        out = []
        for w in workers:
            flight = w.in_flight + w.shared_in_flight
            m = matches.get(w.worker_id, 0) // w.hash_ratio
            resident = self.index.num_blocks(w.worker_id) // w.hash_ratio
            epoch = self.index.epoch(w.worker_id)
            ended = w.done_since_poll - w.sent_since_poll
            base = w.base
            assert base is not None, "only available workers (polled, so with a view) are candidates"
            if m or flight or ended > 0 or resident != base.resident_blocks or epoch != base.residency_epoch:
                view = with_fields(
                    base,
                    matched_blocks=m,
                    in_flight=flight,
                    resident_blocks=resident,
                    residency_epoch=epoch,
                    **less_held(base, ended),
                )
            else:
                view = base
            if slow and w.worker_id in slow:
                host, disk = slow[w.worker_id]
                view = with_fields(
                    view,
                    matched_host_blocks=host // w.hash_ratio,
                    matched_disk_blocks=disk // w.hash_ratio,
                )
            out.append(view)
        return tuple(out)

    def models(self) -> dict[str, int]:
        """Served model name -> its smallest max_model_len over the healthy workers."""
        out: dict[str, int] = {}
        for w in self.workers.values():
            if w.healthy and w.model:
                n = w.state.get("max_model_len") or 1 << 31
                out[w.model] = min(out.get(w.model, n), n)
        return out

    def generation_defaults(self, model: str) -> GenerationDefaults:
        """The sampling defaults `model`'s healthy workers serve it with, where they all are
        kvgate workers and agree, so the gateway reads a request's budget as they will; else
        none (OpenAI's): the gateway then reads the largest budget any worker may use and caps
        none, so it refuses nothing a worker would take (a vLLM worker's defaults are not known
        here)."""
        found: GenerationDefaults | None = None
        for w in self.workers.values():
            if w.healthy and w.model == model:
                if w.kind != KVGATE or (found is not None and w.generation_defaults != found):
                    return NEUTRAL
                found = w.generation_defaults
        return NEUTRAL if found is None else found

    def begin(self, w: Worker, request_id: str = "", sent: Sent | None = None) -> None:
        """Count a request sent to `w` at once, when it is decided: the next decision, here or
        (through `on_change`) at another replica, must see it; `sent`: its ledger entry."""
        self._wake(w)
        if sent is not None:
            w.ledger.add(request_id, sent)
            self._note(SENT, w, request_id, sent=sent)
        w.in_flight += 1
        w.sent_since_poll += 1
        self._rearm(w)
        if self.on_change is not None:
            self.on_change(w, 1)

    def shared(self, w: Worker, delta: int) -> None:
        """Another replica sent `w` a request (`delta` 1) or saw one end (-1): counted between
        polls as this gateway's own are, so its view of `w` loses every replica's ended requests
        at once (counting only its own, each of two replicas kept the other's ended requests in
        its view until the next poll)."""
        if delta > 0:
            self._wake(w)
            w.sent_since_poll += 1
        else:
            w.done_since_poll += 1
        w.shared_in_flight = max(0, w.shared_in_flight + delta)
        self._rearm(w)

    def _wake(self, w: Worker) -> None:
        """A request is about to be sent to `w`: if it holds none, it is polled as a busy worker
        is, an interval after this at the latest, not at the end of an idle worker's long poll."""
        if idle(w):
            w.woken_at = time.monotonic()

    def end(self, w: Worker, request_id: str = "") -> None:
        """A request sent to `w` ended; `request_id`: the one in its ledger."""
        if request_id and request_id in w.ledger.sent:
            w.ledger.end(request_id)
            self._note(ENDED, w, request_id)
        w.in_flight -= 1
        w.done_since_poll += 1
        self._rearm(w)
        if self.on_change is not None:
            self.on_change(w, -1)

    def started(self, w: Worker, request_id: str, at: float) -> None:
        """The first token of a request sent to `w` came at `at` (`policies.ledger`)."""
        entry = w.ledger.sent.get(request_id)
        if entry is not None and entry.started_at is None:
            w.ledger.start(request_id, at)
            self._note(STARTED, w, request_id, at=at)

    def routed(self, w: Worker, request_id: str, prompt: tuple[int, ...], num_tokens: int, at: float) -> None:
        """A prompt of `num_tokens` tokens (full blocks hashing to `prompt`) was sent to `w` at
        `at`, for its prefill: for the other replicas' policies (`policies.api.Observer`)."""
        self._note(ROUTED, w, request_id, prompt=prompt, num_tokens=num_tokens, at=at)

    def tallied(self, tally: Tally) -> None:
        """A decision added `tally` to the policy's windows: for the other replicas' policies
        (`policies.api.Tallied`); nothing is built where no Redis state listens."""
        if self.on_ledger is not None:
            self.on_ledger(LedgerNote("", TALLY, tally=tally))

    def _note(
        self,
        kind: str,
        w: Worker,
        request_id: str,
        sent: Sent | None = None,
        at: float | None = None,
        prompt: tuple[int, ...] = (),
        num_tokens: int = 0,
    ) -> None:
        """Hand a change to `w`'s ledger, or a routing, to `on_ledger` (the replica's name is
        Redis's to add); nothing is built where no Redis state listens."""
        if self.on_ledger is not None and w.worker_id:
            note = LedgerNote("", kind, w.worker_id, request_id, sent=sent, at=at, prompt=prompt, num_tokens=num_tokens)
            self.on_ledger(note)
