"""A router's ledger of what it has in flight at a worker (policies/ledger.py), the wait it
predicts (policies.predict.ledger_wait_ms) and the footprint ranks slo_goodput refuses by
(policies/footprints.py)."""

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from policies.api import RequestView, WorkerView
from policies.footprints import Footprints
from policies.ledger import MAX_COUNT, MAX_TOKENS, Ledger, Sent
from policies.predict import decode_step_ms, ledger_wait_ms

STEP = 0.02


def test_an_empty_pool_starts_a_request_at_once():
    assert Ledger().start_s(100, 40, 8, STEP, now=0.0) == 0.0


def test_a_full_pool_starts_it_when_enough_running_requests_have_ended():
    led = Ledger()
    led.add("a", Sent(need=50, hit=(), max_tokens=100, started_at=0.0))  # 40 of 100 steps done at 0.8 s
    led.add("b", Sent(need=40, hit=(), max_tokens=100, started_at=0.6))  # 10 done
    # 10 blocks free: 30 more come back when a ends (60 steps on), 70 when b does (90 on)
    assert led.start_s(100, 10, 8, STEP, now=0.8) == 0.0
    assert led.start_s(100, 40, 8, STEP, now=0.8) == pytest.approx(60 * STEP)
    assert led.start_s(100, 70, 8, STEP, now=0.8) == pytest.approx(90 * STEP)


def test_requests_sent_before_take_their_room_first():
    led = Ledger()
    led.add("run", Sent(need=80, hit=(), max_tokens=50, started_at=0.0))
    assert led.start_s(100, 20, 8, STEP, now=0.0) == 0.0
    led.add("queued", Sent(need=20, hit=(), max_tokens=10))  # no first token yet: it waits ahead
    assert led.start_s(100, 20, 8, STEP, now=0.0) == pytest.approx(10 * STEP)  # after the queued one's 10 steps


def test_a_prefix_shared_by_running_requests_is_counted_once_and_freed_with_the_last():
    led = Ledger()
    prefix = tuple(range(30))
    led.add("a", Sent(need=10, hit=prefix, max_tokens=100, started_at=0.0))
    led.add("b", Sent(need=10, hit=prefix, max_tokens=100, started_at=0.0))
    assert len(led.pinned) == 30  # 30 + 10 + 10 in use of 100: 50 free
    assert led.start_s(100, 50, 8, STEP, now=0.0) == 0.0
    assert led.start_s(100, 51, 8, STEP, now=0.0) > 0.0
    led.end("a")
    assert len(led.pinned) == 30
    led.end("b")
    led.end("b")  # ending twice (a retry's failure path) is harmless
    assert not led.pinned and len(led) == 0


def test_a_request_counts_its_prefix_once_its_first_token_came():
    led = Ledger()
    led.add("a", Sent(need=10, hit=(1, 2, 3), max_tokens=100))
    assert not led.pinned
    led.start("a", 1.0)
    led.start("a", 2.0)  # only the first token counts
    assert dict(led.pinned) == {1: 1, 2: 1, 3: 1} and led.sent["a"].started_at == 1.0


def test_an_entry_is_its_blocks_at_its_end_less_its_hit_in_worker_blocks():
    e = Sent.of(num_tokens=100, max_tokens=60, block_hashes=tuple(range(20)), cached_tokens=48, block_size=16)
    assert (e.need, e.hit, e.max_tokens) == (10 - 3, (0, 1, 2), 60)
    # a vLLM worker of 32-token blocks behind a 16-token index: two hashes a block, the second names it
    e = Sent.of(100, 60, tuple(range(20)), cached_tokens=64, block_size=32, hash_ratio=2, started_at=0.0)
    assert (e.need, e.hit) == (5 - 2, (1, 3))
    led = Ledger()
    led.add("v", e)
    assert led.start_s(10, 5, 8, STEP, now=0.0) == 0.0  # 10 - 2 pinned - 3 = 5 free
    assert led.start_s(10, 6, 8, STEP, now=0.0) > 0.0


entries = st.lists(
    st.tuples(st.integers(1, 60), st.integers(1, 200), st.one_of(st.none(), st.floats(0.0, 3.0))), max_size=12
)


@given(entries, st.integers(1, 100), st.integers(1, 100))
def test_a_larger_request_or_one_more_ahead_never_starts_sooner(sent, small, extra):
    led = Ledger()
    for i, (need, steps, started) in enumerate(sent):
        led.add(str(i), Sent(need, (), steps, started))
    now = 3.0
    base = led.start_s(120, small, 16, STEP, now)
    assert base >= 0.0
    assert led.start_s(120, small + extra, 16, STEP, now) >= base
    led.add("ahead", Sent(extra, (), 16))
    assert led.start_s(120, small, 16, STEP, now) >= base


accepted = st.builds(
    Sent,
    need=st.integers(0, MAX_COUNT),
    hit=st.lists(st.integers(0, MAX_COUNT), max_size=4).map(tuple),
    max_tokens=st.integers(1, MAX_TOKENS),
    started_at=st.none() | st.floats(allow_nan=False, allow_infinity=False),
)


@given(st.lists(accepted, max_size=6), st.floats(1e-6, 10.0), st.floats(0.0, 2e9))
@example([Sent(need=1, hit=(), max_tokens=8, started_at=-1e308)], STEP, 0.0)
def test_no_entry_another_replica_may_send_makes_the_start_raise(sent, step_s, now):
    """Every entry `Sent.from_json` accepts (another replica's, through Redis) is priced: a start
    time far back once overflowed the steps it had run, and a request routed there got a 500."""
    led = Ledger()
    for i, e in enumerate(sent):
        led.add(str(i), Sent.from_json(e.to_json()))
    assert 0.0 <= led.start_s(1 << 20, 40, 8, step_s, now) < float("inf")


def test_a_request_that_started_long_ago_has_run_all_its_steps():
    led = Ledger()
    led.add("old", Sent(need=90, hit=(), max_tokens=10, started_at=-1e308))
    assert led.start_s(100, 20, 8, STEP, now=0.0) == pytest.approx(STEP)  # its last step, then room


def test_an_entry_holds_at_most_max_tokens_steps():
    e = Sent.of(num_tokens=16, max_tokens=10**400, block_hashes=(), cached_tokens=0, block_size=16)
    assert e.max_tokens == MAX_TOKENS and e.need == (16 + MAX_TOKENS) // 16
    assert Sent.from_json(e.to_json()) == e


def view(led: Ledger | None, **kw) -> WorkerView:
    fields = dict(worker_id="w", block_size=16, total_blocks=100, free_blocks=50, running=2, ledger=led)
    return WorkerView(**{**fields, **kw})


def test_the_ledger_wait_is_only_given_where_the_ledger_covers_the_worker():
    led = Ledger()
    led.add("a", Sent(need=80, hit=(), max_tokens=100, started_at=0.0))
    led.add("b", Sent(need=10, hit=(), max_tokens=100, started_at=0.0))
    req = RequestView("r", 200, tuple(range(12)), max_tokens=64)  # 17 blocks at its end
    step = decode_step_ms(view(led, in_flight=2))
    assert ledger_wait_ms(req, view(led, in_flight=2), now=0.0) == pytest.approx(100 * step)
    assert ledger_wait_ms(req, view(led, in_flight=2, matched_blocks=8), now=0.0) == 0.0  # 9 blocks fit
    assert ledger_wait_ms(req, view(led, in_flight=3), now=0.0) is None  # another replica sends there
    assert ledger_wait_ms(req, view(led, in_flight=1), now=0.0) is None  # an entry the router did not end
    assert ledger_wait_ms(req, view(led, in_flight=2, running=7), now=0.0) is None  # so do other clients
    assert ledger_wait_ms(req, view(led, in_flight=2, total_blocks=0), now=0.0) is None
    assert ledger_wait_ms(req, view(None), now=0.0) is None


def test_footprints_rank_a_request_among_the_recent_ones():
    f = Footprints(window=100, warmup=10)
    for n in range(9):
        f.add(n)
    assert f.share_below(1000) == 0.0  # too few seen to rank
    f.add(9)
    assert f.share_below(1000) == 1.0 and f.share_below(5) == 0.5 and f.share_below(0) == 0.0
    for n in range(200):
        f.add(100 + n)
    assert len(f.ordered) == 100 and f.ordered[0] == 200  # only the last 100 count
    assert f.share_below(250) == 0.5
