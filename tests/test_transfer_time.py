"""The P/D transfer timing model (workers/kv/transfer_time.py): the closed form the predictor
uses is the batch-by-batch link the simulator replays, and what it adds to TTFT behaves."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.kv.transfer_time import Link, exposed, num_batches

times = st.floats(0.0, 10.0, allow_nan=False)
positive = st.floats(1e-3, 10.0, allow_nan=False)


def replay(prefill: float, wire: float, computed: float, m: int, latency: float, backlog: float = 0.0) -> float:
    """`Link.lands_s` over the batches `exposed` describes: m batches ready at k/m of the
    prefill, the computed wire spread evenly, the rest with the first, on a link busy until
    `backlog`; minus the prefill."""
    link = Link(latency, 1e-9)  # 1 byte takes 1 time unit
    lands = backlog
    for k in range(1, m + 1):
        size = computed / m + (wire - computed if k == 1 else 0.0)
        lands = link.lands_s(prefill * k / m, lands, size)
    return lands - prefill


@given(times, positive, st.floats(0.0, 1.0), st.integers(1, 64), times, times)
def test_the_closed_form_is_the_batch_by_batch_link(prefill, wire, share, m, latency, backlog):
    assert exposed(prefill, wire, wire * share, m, latency, backlog) == pytest.approx(
        replay(prefill, wire, wire * share, m, latency, backlog), rel=1e-9, abs=1e-9
    )


@given(times, positive, st.floats(0.0, 1.0), st.integers(1, 64), times)
def test_what_a_transfer_adds_is_bounded_and_never_negative(prefill, wire, share, m, latency):
    """TTFT is never less than the prefill plus the fixed cost, nor more than the prefill and
    the whole transfer after it; one batch is exactly the whole transfer after the prefill."""
    added = exposed(prefill, wire, wire * share, m, latency)
    assert latency <= added <= latency + wire + 1e-12
    assert exposed(prefill, wire, wire * share, 1, latency) == pytest.approx(latency + wire)


@given(times, positive, st.floats(0.0, 1.0), st.integers(1, 63), times, positive)
def test_more_batches_or_a_longer_prefill_hide_more_and_more_bytes_hide_less(prefill, wire, share, m, latency, more):
    base = exposed(prefill, wire, wire * share, m, latency)
    assert exposed(prefill, wire, wire * share, m + 1, latency) <= base + 1e-12
    assert exposed(prefill + more, wire, wire * share, m, latency) <= base + 1e-12
    assert exposed(prefill, wire + more, (wire + more) * share, m, latency) >= base - 1e-12


@given(times, positive, st.integers(1, 64), times)
def test_a_prefill_at_least_as_long_as_the_wire_hides_all_but_the_last_batch(prefill, wire, m, latency):
    if prefill >= wire:
        assert exposed(prefill, wire, wire, m, latency) == pytest.approx(latency + wire / m)


def test_batches_follow_the_export_rule():
    """The cases tests/test_export_batches.py runs through the engine (25 blocks of 4 tokens,
    32-token steps): 0 -> 1 batch, 4 and 8 -> 4, 9 -> 2, 100 -> 1."""
    assert [num_batches(25, 32, 4, k) for k in (0, 4, 8, 9, 100)] == [1, 4, 4, 2, 1]
    assert num_batches(0, 32, 4, 4) == 1


def test_a_link_queues_bytes_behind_earlier_batches():
    link = Link(0.5, 1e-9)
    assert link.lands_s(0.0, 0.0, 2.0) == 2.5
    assert link.lands_s(1.0, 4.0, 2.0) == 6.0, "the wire is busy until 4: the fixed cost hid"
