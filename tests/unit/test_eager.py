"""shardtrain.eager: work runs in the caller's turn until it first waits; the rest runs as a task."""

from __future__ import annotations

import asyncio

import pytest

from shardtrain import eager


def test_work_that_never_waits_is_done_before_start_returns():
    async def scenario():
        done = []

        async def work():
            ready = asyncio.get_running_loop().create_future()
            ready.set_result(5)
            done.append(await ready)  # a future already done: no wait
        started = eager.start(work())
        return list(done), started.done(), started.result()
    assert asyncio.run(scenario()) == ([5], True, None), "a done future, as if a task had run it"


def test_the_value_of_work_that_never_waits_is_in_the_returned_future():
    async def scenario():
        async def work():
            return "value"
        started = eager.start(work())
        return started.done(), await started
    assert asyncio.run(scenario()) == (True, "value")


def test_work_that_waits_runs_its_start_now_and_the_rest_as_a_task():
    async def scenario():
        loop = asyncio.get_running_loop()
        gate = loop.create_future()
        steps = []

        async def work():
            steps.append("start")
            value = await gate
            steps.append(("woken", value))
            await asyncio.sleep(0)  # a bare yield to the loop is handed on as well
            steps.append("end")
            return value * 2
        task = eager.start(work())
        started = list(steps)
        loop.call_soon(gate.set_result, 21)
        return started, await task, steps
    started, result, steps = asyncio.run(scenario())
    assert started == ["start"], "the work ran up to its wait before start() returned"
    assert result == 42 and steps == ["start", ("woken", 21), "end"]


def test_an_error_before_the_first_wait_is_in_the_returned_future():
    async def scenario():
        async def work():
            raise ValueError("bad item")
        started = eager.start(work())
        assert started.done()
        await started
    with pytest.raises(ValueError, match="bad item"):
        asyncio.run(scenario())


def test_an_error_after_a_wait_is_the_tasks():
    async def scenario():
        loop = asyncio.get_running_loop()
        gate = loop.create_future()

        async def work():
            await gate
            raise KeyError("late")
        task = eager.start(work())
        loop.call_soon(gate.set_exception, RuntimeError("the wait failed"))
        caught = []
        try:
            await task
        except RuntimeError as error:
            caught.append(str(error))
        return caught
    assert asyncio.run(scenario()) == ["the wait failed"], "the failed wait raised inside the work, as in a task"


def test_cancelling_the_task_cancels_the_wait_inside_the_work():
    async def scenario():
        loop = asyncio.get_running_loop()
        gate = loop.create_future()
        seen = []

        async def work():
            try:
                await gate
            except asyncio.CancelledError:
                seen.append("cancelled inside")
                raise
            finally:
                seen.append("cleaned up")
        task = eager.start(work())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return task.cancelled(), gate.cancelled(), seen
    cancelled, gate_cancelled, seen = asyncio.run(scenario())
    assert cancelled and gate_cancelled
    assert seen == ["cancelled inside", "cleaned up"]
