"""How the gateway reads a worker's liveness from its /state: pure, no processes."""

import asyncio
import time

from gateway.fleet import LONG_POLL_S, Fleet
from gateway.worker import DRAINING, out_of_service
from gateway.index import ResidencyIndex

STATE = {"worker_id": "w", "model": "m"}


def test_a_worker_is_out_while_its_engine_is_dead_stalled_or_draining():
    assert out_of_service(STATE, 1.5) is None  # a worker that reports none of it counts as fine
    assert out_of_service({**STATE, "engine_alive": True, "engine_stall_s": 1.5}, 1.5) is None
    assert "not running" in out_of_service({**STATE, "engine_alive": False}, 1.5)
    assert "no progress" in out_of_service({**STATE, "engine_stall_s": 1.6}, 1.5)
    assert out_of_service({**STATE, "draining": True}, 1.5) == DRAINING


def test_losing_a_worker_resolves_its_lost_future_but_draining_does_not():
    async def run():
        fleet = Fleet(ResidencyIndex(), stall_s=1.5)
        w = fleet.add("http://w")
        fleet.up(w, STATE)
        lost = fleet.lost(w)
        fleet.up(w, {**STATE, "draining": True})
        assert not w.available and not lost.done()  # in flight on a draining worker: let it finish
        fleet.up(w, {**STATE, "engine_stall_s": 2.0})
        assert lost.done() and "no progress" in lost.result()
        fleet.up(w, STATE)
        assert w.available and not fleet.lost(w).done()

    asyncio.run(run())


def test_a_stalling_worker_is_polled_again_as_its_stall_passes_the_limit():
    fleet = Fleet(ResidencyIndex(), interval=0.5, stall_s=1.5)
    w = fleet.add("http://w")
    fleet.up(w, {**STATE, "engine_stall_s": 0.01})
    assert fleet.next_poll_s(w, 0.0) == 0.5
    fleet.up(w, {**STATE, "engine_stall_s": 1.3})
    assert abs(fleet.next_poll_s(w, 0.0) - 0.25) < 1e-9


def test_an_idle_worker_whose_kv_event_answers_carry_its_state_is_polled_once_a_long_poll():
    fleet = Fleet(ResidencyIndex(), interval=0.5, timeout=1.0)
    w = fleet.add("http://w")
    fleet.up(w, {**STATE, "waiting": 0, "running": 0})
    assert fleet.next_poll_s(w, 0.0) == 0.5  # no state on its KV-event answers (yet): polled as ever
    w.state_rides = True
    assert fleet.next_poll_s(w, 0.0) == LONG_POLL_S + 1.0
    fleet.begin(w)  # a request sent to it: polled at the interval while it may hold it
    assert fleet.next_poll_s(w, 0.0) == 0.5
    fleet.up(w, {**STATE, "waiting": 0, "running": 1})
    fleet.end(w)  # what it reported running has finished, as far as this gateway knows
    assert fleet.next_poll_s(w, 0.0) == LONG_POLL_S + 1.0
    fleet.up(w, {**STATE, "waiting": 1, "running": 1})  # work from elsewhere
    assert fleet.next_poll_s(w, 0.0) == 0.5


def test_the_pollers_wait_moves_with_the_workers_lines_and_requests():
    """The poller sleeps until a poll is due and is woken only then: a request sent to an idle
    worker brings its poll to an interval away, a KV-event line with its state pushes it back,
    the request's end (idle again) pushes it to the long poll; a stall nearing the limit, a
    due time already past, or the worker going down brings it forward."""

    async def run():
        fleet = Fleet(ResidencyIndex(), interval=0.5, timeout=1.0, stall_s=1.5)
        w = fleet.add("http://w")
        fleet.up(w, {**STATE, "waiting": 0, "running": 0})
        w.state_rides = True
        loop = asyncio.get_running_loop()
        nap = asyncio.create_task(fleet._nap(w, fleet.poll_wait_s(w)))
        await asyncio.sleep(0)

        def due() -> float:
            assert w.nap_timer is not None and not nap.done()
            return w.nap_timer.when() - loop.time()

        assert abs(due() - (LONG_POLL_S + 1.0)) < 0.05
        fleet.begin(w)
        assert abs(due() - 0.5) < 0.05
        await asyncio.sleep(0.2)
        fleet.up(w, {**STATE, "waiting": 0, "running": 1})  # its prefill's line: the poll waits again
        assert abs(due() - 0.5) < 0.05
        fleet.end(w)
        assert abs(due() - (LONG_POLL_S + 1.0)) < 0.05
        fleet.up(w, {**STATE, "waiting": 0, "running": 1, "engine_stall_s": 1.45})
        assert abs(due() - 0.1) < 0.05
        w.state_at = w.tried = w.woken_at = time.monotonic() - 10.0
        fleet._rearm(w)
        await asyncio.sleep(0)
        assert nap.done() and w.nap is None
        fleet.up(w, {**STATE, "waiting": 0, "running": 0})
        nap = asyncio.create_task(fleet._nap(w, fleet.poll_wait_s(w)))
        await asyncio.sleep(0)
        assert abs(due() - (LONG_POLL_S + 1.0)) < 0.05
        fleet.down(w, "its KV-event stream broke")  # polled within an interval, not a long poll
        assert abs(due() - 0.5) < 0.05
        nap.cancel()

    asyncio.run(run())


def test_a_state_with_the_same_cost_model_keeps_its_parsed_cost_model():
    fleet = Fleet(ResidencyIndex())
    w = fleet.add("http://w")
    cost = {"base_ms": 5.0, "decode_batch_ms": [1.0, 2.0]}
    fleet.up(w, {**STATE, "cost_model": cost})
    parsed = w.base.cost
    fleet.up(w, {**STATE, "cost_model": dict(cost), "running": 1})
    assert w.base.cost is parsed and w.base.running == 1
    fleet.up(w, {**STATE, "cost_model": {**cost, "base_ms": 6.0}})
    assert w.base.cost.base_ms == 6.0
