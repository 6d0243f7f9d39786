"""The per-worker circuit breaker and the retry backoff: pure, on a fake clock."""

import random

from hypothesis import given
from hypothesis import strategies as st

from gateway.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerConfig
from gateway.retry import RetryPolicy


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def breaker(failures: int = 3, cooldown: float = 2.0, cap: float = 30.0) -> tuple[Breaker, Clock]:
    clock = Clock()
    return Breaker(BreakerConfig(failures, cooldown, cap), clock), clock


def test_opens_after_consecutive_failures_only():
    b, _ = breaker()
    b.failed(), b.failed(), b.succeeded(), b.failed(), b.failed()
    assert b.state == CLOSED and b.allows()
    assert b.failed() is True
    assert b.state == OPEN and not b.allows()


def test_half_open_lets_one_trial_through_and_its_outcome_decides():
    b, clock = breaker(failures=1, cooldown=2.0)
    b.failed()
    clock.now = 1.9
    assert not b.allows()
    clock.now = 2.0
    assert b.state == HALF_OPEN and b.allows()
    b.attempt()
    assert not b.allows()  # the trial is out: nobody else
    b.failed()  # the trial failed: open again, for twice as long
    clock.now = 5.9
    assert b.state == OPEN
    clock.now = 6.0
    assert b.allows()
    b.attempt()
    b.succeeded()
    assert b.state == CLOSED and b.allows() and b.opened == 0


def test_a_released_trial_lets_the_next_one_try():
    b, clock = breaker(failures=1)
    b.failed()
    clock.now = 10
    b.attempt()
    assert not b.allows()
    b.released()
    assert b.allows()


@given(st.lists(st.booleans(), max_size=60))
def test_cooldown_never_exceeds_its_cap(outcomes):
    b, clock = breaker(failures=2, cooldown=1.0, cap=8.0)
    for ok in outcomes:
        clock.now += 0.5
        b.succeeded() if ok else b.failed()
        assert b.until - clock.now <= 8.0


def test_backoff_doubles_with_jitter_up_to_its_cap():
    policy, rng = RetryPolicy(max_retries=5, backoff_s=0.1, max_backoff_s=0.3), random.Random(0)
    for retry, base in ((1, 0.1), (2, 0.2), (3, 0.3), (4, 0.3)):
        delays = [policy.delay(retry, rng) for _ in range(200)]
        assert base * 0.5 <= min(delays) and max(delays) <= base


def test_a_worker_back_after_a_failed_poll_starts_with_a_closed_breaker():
    """A restarted worker is a new process: the failures of the one that died do not keep it out."""
    from gateway.fleet import Fleet
    from gateway.index import ResidencyIndex

    fleet = Fleet(ResidencyIndex(), breaker=BreakerConfig(failures=1, cooldown_s=60))
    w = fleet.add("http://w")
    fleet.up(w, {"worker_id": "w", "model": "m"})
    w.breaker.failed()
    assert not w.available
    fleet.up(w, {"worker_id": "w", "model": "m"})  # still answering its polls: the breaker stands
    assert not w.available
    fleet.down(w, "refused")
    fleet.up(w, {"worker_id": "w", "model": "m"})
    assert w.available
