"""shardtrain.eager: a coroutine runs at once until it first waits, then on as a Task."""

from __future__ import annotations

import asyncio

import pytest

from shardtrain import eager


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_coroutine_that_never_waits_finishes_inside_start():
    done = []

    async def work():
        done.append("ran")

    async def scenario():
        assert eager.start(work()) is None
        assert done == ["ran"]  # before start returned, with no turn of the loop
    run(scenario())


def test_a_coroutine_runs_up_to_its_first_wait_then_resumes_as_a_task():
    events = []

    async def work(future):
        events.append("before")
        value = await future
        events.append(f"after {value}")
        return value * 2

    async def scenario():
        future = asyncio.get_running_loop().create_future()
        task = eager.start(work(future))
        assert events == ["before"]
        assert isinstance(task, asyncio.Task)
        future.set_result(21)
        assert await task == 42
        assert events == ["before", "after 21"]
    run(scenario())


def test_what_it_raises_before_waiting_is_raised_by_start():
    async def work():
        raise ValueError("bad item")

    async def scenario():
        with pytest.raises(ValueError, match="bad item"):
            eager.start(work())
    run(scenario())


def test_a_failed_future_raises_inside_the_coroutine_where_it_waits():
    async def work(future):
        try:
            await future
        except KeyError as error:
            return f"caught {error}"

    async def scenario():
        future = asyncio.get_running_loop().create_future()
        task = eager.start(work(future))
        future.set_exception(KeyError("lost"))
        assert await task == "caught 'lost'"
    run(scenario())


def test_what_it_raises_after_waiting_ends_the_task():
    async def work():
        await asyncio.sleep(0)
        raise RuntimeError("later")

    async def scenario():
        task = eager.start(work())
        with pytest.raises(RuntimeError, match="later"):
            await task
    run(scenario())


def test_it_waits_several_times_and_on_bare_yields():
    async def work(first, second):
        await asyncio.sleep(0)
        a = await first
        await asyncio.sleep(0)
        return a + await second

    async def scenario():
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        task = eager.start(work(first, second))
        loop.call_later(0.01, first.set_result, 1)
        loop.call_later(0.02, second.set_result, 2)
        assert await asyncio.wait_for(task, 5) == 3
    run(scenario())


def test_cancelling_the_task_cancels_the_coroutine_where_it_waits():
    seen = []

    async def work(future):
        try:
            await future
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("cleaned up")

    async def scenario():
        future = asyncio.get_running_loop().create_future()
        task = eager.start(work(future))
        await asyncio.sleep(0)  # the task is waiting now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled", "cleaned up"]
        assert future.cancelled()  # as a Task cancels what its coroutine waits on
    run(scenario())


def test_a_coroutine_may_swallow_a_cancellation_and_go_on():
    async def work(future, other):
        try:
            await future
        except asyncio.CancelledError:
            return await other

    async def scenario():
        loop = asyncio.get_running_loop()
        future, other = loop.create_future(), loop.create_future()
        task = eager.start(work(future, other))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)
        other.set_result("went on")
        assert await task == "went on"
    run(scenario())
