"""The engine under faults, in process: a step that raises, a loop that breaks, a dead thread."""

import threading

import pytest

from tests.sim_engine import drain, sim_engine
from workers.engine import EngineStopped
from workers.sampling_params import SamplingParams


class Outputs:
    """Collects every request's outputs; `done` is set when `n` requests have finished."""

    def __init__(self, n: int):
        self.by_id: dict[str, list] = {}
        self.n = n
        self.done = threading.Event()

    def sink(self, out) -> None:
        self.by_id.setdefault(out.request_id, []).append(out)
        if sum(o[-1].finish_reason is not None for o in self.by_id.values()) >= self.n:
            self.done.set()

    def last(self, rid: str):
        return self.by_id[rid][-1]


def params(n: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_step_exception_fails_that_steps_requests_only():
    eng = sim_engine()
    real = eng.executor.execute

    def execute(chunks):
        if any(c.start_pos == 0 and c.token_ids[0] == 777 for c in chunks):
            raise RuntimeError("boom")
        return real(chunks)

    eng.executor.execute = execute
    out = Outputs(3)
    eng.submit("ok", [10, 11, 12], params(8), out.sink)
    eng.step()  # "ok" prefills alone
    eng.submit("bad", [777, 5, 6], params(), out.sink)
    drain(eng)
    eng.submit("later", [20, 21], params(), out.sink)
    drain(eng)
    assert out.last("bad").finish_reason == "error" and out.last("bad").error == "engine_error"
    assert out.last("ok").finish_reason == "error", "'ok' shared the failing step"
    assert out.last("later").finish_reason == "length" and out.last("later").num_output == 4
    assert eng.pool.num_free == eng.pool.num_blocks
    assert eng.stats.failed == 2


def test_request_not_in_the_failing_step_is_unaffected():
    eng = sim_engine(max_num_seqs=1)
    real = eng.executor.execute
    eng.executor.execute = lambda chunks: (
        (_ for _ in ()).throw(RuntimeError("boom"))
        if any(c.token_ids[0] == 777 and c.start_pos == 0 for c in chunks)
        else real(chunks)
    )
    out = Outputs(2)
    eng.submit("first", [10, 11], params(3), out.sink)
    eng.submit("bad", [777, 1], params(3), out.sink)  # waits: one sequence at a time
    drain(eng)
    assert out.last("first").finish_reason == "length" and out.last("first").num_output == 3
    assert out.last("bad").finish_reason == "error"


def test_a_broken_loop_fails_everything_in_flight_and_goes_on():
    eng = sim_engine()
    real = eng.scheduler.schedule
    calls = {"n": 0}

    def schedule():
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("scheduler bug")
        return real()

    eng.scheduler.schedule = schedule
    out = Outputs(2)
    eng.start()
    try:
        eng.submit("a", [1, 2, 3], params(50), out.sink)
        eng.submit("b", [4, 5, 6], params(50), out.sink)
        assert out.done.wait(10)
        assert {out.last(r).finish_reason for r in "ab"} == {"error"}
        again = Outputs(1)
        eng.submit("c", [7, 8], params(3), again.sink)
        assert again.done.wait(10) and again.last("c").finish_reason == "length"
        assert eng.alive and eng.pool.num_free == eng.pool.num_blocks
    finally:
        eng.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_engine_fails_in_flight_and_refuses_new_requests():
    eng = sim_engine()

    def die(chunks):
        raise SystemExit("gone")

    eng.executor.execute = die
    out = Outputs(1)
    eng.start()
    try:
        eng.submit("a", [1, 2, 3], params(), out.sink)
        assert out.done.wait(10)
        assert out.last("a").finish_reason == "error" and out.last("a").error == "engine_stopped"
        eng._thread.join(10)
        assert not eng.alive
        with pytest.raises(EngineStopped):
            eng.submit("b", [1], params(), out.sink)
    finally:
        eng.stop()


def test_stall_is_zero_when_idle():
    eng = sim_engine()
    eng.start()
    try:
        assert eng.stall_s() == 0.0
    finally:
        eng.stop()


def test_max_model_len_is_capped_by_the_pool():
    assert sim_engine(num_blocks=64, block_size=4).max_model_len == 256
    assert sim_engine(num_blocks=10_000, block_size=16).max_model_len == 4096  # the executor's
