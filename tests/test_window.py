"""policies.window.TimedCounts (on a TimedWindow) against a recount of every addition."""

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from policies.window import TimedCounts

steps = st.lists(st.tuples(st.integers(0, 3), st.floats(0, 20, allow_nan=False)), max_size=60)


@given(steps, st.floats(0.1, 5))
def test_counts_are_the_additions_within_the_window_in_time_order(adds, window_s):
    counts: TimedCounts[int] = TimedCounts(window_s)
    history: list[tuple[float, int]] = []  # every addition at the time it was counted
    for key, now in adds:
        counts.add(key, now)
        history.append((max(now, history[-1][0]) if history else now, key))
        latest = history[-1][0]  # what expired once stays expired: the window ends at the latest time seen
        kept = [(t, k) for t, k in history if t >= latest - window_s]
        assert list(counts.window.items) == kept
        assert counts.count == Counter(k for _, k in kept) and 0 not in counts.count.values()


def test_a_late_addition_counts_at_the_latest_time_and_expires_with_it():
    counts: TimedCounts[str] = TimedCounts(1.0)
    counts.add("a", 10.0)
    counts.add("b", 9.0)  # another replica's, heard late
    assert [t for t, _ in counts.window.items] == [10.0, 10.0]
    counts.expire(10.9)
    assert len(counts) == 2
    counts.expire(11.1)
    assert len(counts) == 0 and not counts.count
