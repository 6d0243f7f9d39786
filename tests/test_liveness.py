"""How the gateway reads a worker's liveness from its /state: pure, no processes."""

import asyncio

from gateway.fleet import DRAINING, Fleet, out_of_service
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
        fleet._up(w, STATE)
        lost = fleet.lost(w)
        fleet._up(w, {**STATE, "draining": True})
        assert not w.available and not lost.done()  # in flight on a draining worker: let it finish
        fleet._up(w, {**STATE, "engine_stall_s": 2.0})
        assert lost.done() and "no progress" in lost.result()
        fleet._up(w, STATE)
        assert w.available and not fleet.lost(w).done()

    asyncio.run(run())


def test_a_stalling_worker_is_polled_again_as_its_stall_passes_the_limit():
    fleet = Fleet(ResidencyIndex(), interval=0.5, stall_s=1.5)
    w = fleet.add("http://w")
    fleet._up(w, {**STATE, "engine_stall_s": 0.01})
    assert fleet.next_poll_s(w, 0.0) == 0.5
    fleet._up(w, {**STATE, "engine_stall_s": 1.3})
    assert abs(fleet.next_poll_s(w, 0.0) - 0.25) < 1e-9
