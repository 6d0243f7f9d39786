"""Stopping endless tasks (workers/background.py `cancel_and_wait`): a task that swallows a
cancel, as redis-py 8.2 at times does inside a blocking XREAD while the loop around it reads on,
is cancelled again until it ends; the Redis tail and publisher stop through it. `ends`' 30 s only
keeps a hang from stalling the suite."""

import asyncio

import pytest

from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.redis_state import RedisState, _first_failure
from workers.background import cancel_and_wait


async def stubborn(swallow: int, log: list[str]) -> None:
    """An endless loop whose first `swallow` cancels are swallowed, as by a blocking read."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            log.append("swallowed")
            if len(log) > swallow:
                raise


async def ends(aw, *stubborn_tasks: asyncio.Task) -> bool:
    """Whether `aw` ends within 30 s (a hang guard, not a timing assert). On a hang the stubborn
    tasks are cancelled until they give in, so that the test fails rather than hangs."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=30)
    while not all(t.done() for t in stubborn_tasks):
        for t in stubborn_tasks:
            t.cancel()
        await asyncio.sleep(0)
    await asyncio.wait({task})
    return bool(done)


@pytest.mark.parametrize("swallow", [0, 1, 3])
def test_a_task_that_swallows_cancels_is_cancelled_until_it_ends(swallow):
    async def run():
        log: list[str] = []
        task = asyncio.create_task(stubborn(swallow, log))
        await asyncio.sleep(0)
        assert await ends(cancel_and_wait(task), task)
        return task, log

    task, log = asyncio.run(run())
    assert task.cancelled() and len(log) == swallow + 1


def test_a_failed_task_is_waited_for_and_its_error_retrieved():
    async def run():
        async def fails():
            raise RuntimeError("boom")

        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        return task

    assert isinstance(asyncio.run(run()).exception(), RuntimeError)


def test_the_caller_cancelled_meanwhile_still_ends_the_tasks_then_is_cancelled():
    async def run():
        log: list[str] = []
        task = asyncio.create_task(stubborn(2, log))
        await asyncio.sleep(0)
        stopper = asyncio.create_task(cancel_and_wait(task))
        await asyncio.sleep(0)
        stopper.cancel()
        await asyncio.wait({stopper}, timeout=30)
        return task, stopper

    task, stopper = asyncio.run(run())
    assert task.cancelled() and stopper.cancelled()


def test_the_redis_tail_stops_though_a_loop_swallows_its_cancel():
    async def run():
        state = RedisState("redis://127.0.0.1:1/0", Fleet(ResidencyIndex()), "secret", replica_id="a")
        log: list[str] = []
        state._task = asyncio.create_task(stubborn(2, log))
        await asyncio.sleep(0)
        assert await ends(state.stop(), state._task)
        return state._task

    assert asyncio.run(run()).cancelled()


def test_the_first_failure_is_raised_though_another_loop_swallows_its_cancel():
    async def run():
        async def fails():
            await asyncio.sleep(0)
            raise ConnectionError("redis went away")

        loop = asyncio.create_task(stubborn(2, []))
        failure = asyncio.ensure_future(_first_failure(fails(), loop))
        assert await ends(asyncio.wait({failure}), loop)
        return failure

    assert isinstance(asyncio.run(run()).exception(), ConnectionError)
