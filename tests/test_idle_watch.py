"""gateway.idle_watch: silence inside a read times out; time outside reads and outside
cancellations do not."""

import asyncio

import pytest

from gateway.idle_watch import IdleWatch


async def reads(watch_s: float, gaps: list[float], outside: float = 0.0) -> int:
    """Reads that each wait `gaps[i]` seconds for data, with `outside` seconds of other work
    (a slow client) between them; returns how many completed."""
    done = 0
    with IdleWatch(watch_s) as w:
        for gap in gaps:
            w.waiting()
            await asyncio.sleep(gap)
            w.got()
            done += 1
            await asyncio.sleep(outside)
    return done


def test_a_read_silent_past_the_limit_times_out():
    with pytest.raises(TimeoutError):
        asyncio.run(reads(0.05, [0.0, 0.01, 0.5]))


def test_quick_reads_and_slow_work_between_them_do_not():
    assert asyncio.run(reads(0.05, [0.0] * 5, outside=0.08)) == 5
    assert asyncio.run(reads(0.2, [0.02] * 10)) == 10


def test_a_cancellation_from_outside_stays_a_cancellation():
    async def main() -> None:
        task = asyncio.ensure_future(reads(10.0, [5.0]))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
