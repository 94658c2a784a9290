"""shard_service.ordering: StepOrder parks callers on the event loop until the runtime answers their waits: optimizer
steps and backward outcomes, with deadlines."""

from __future__ import annotations

import asyncio
import re

import pytest

from shard_service.ordering import StepOrder
from shardtrain.errors import DeadlineExceeded

LONG = 5.0
SHORT = 0.01


def run(coroutine):
    return asyncio.run(coroutine)


async def is_waiting(task: asyncio.Task) -> bool:
    for _ in range(3):
        await asyncio.sleep(0)
    return not task.done()


def test_optimizer_step_zero_needs_no_wait():
    async def scenario():
        await StepOrder().after_optimizer_step(0, SHORT)
    run(scenario())


def test_after_optimizer_step_waits_until_that_step_settles():
    async def scenario():
        order = StepOrder()
        waiter = asyncio.create_task(order.after_optimizer_step(2, LONG))
        assert await is_waiting(waiter)
        await order.optimizer_step_settled(1)
        assert await is_waiting(waiter)
        await order.optimizer_step_settled(2)
        await waiter
    run(scenario())


def test_a_later_settled_step_covers_earlier_ones():
    async def scenario():
        order = StepOrder()
        await order.optimizer_step_settled(3)
        await order.optimizer_step_settled(1)  # late news of an older step does not go back
        await order.after_optimizer_step(3, SHORT)
        await order.after_optimizer_step(2, SHORT)
    run(scenario())


def test_after_optimizer_step_times_out_naming_the_step():
    async def scenario():
        order = StepOrder()
        await order.optimizer_step_settled(1)
        await order.after_optimizer_step(2, SHORT)
    with pytest.raises(DeadlineExceeded, match="optimizer step 2 did not happen within 0.01 s"):
        run(scenario())


def test_waits_work_again_after_a_timeout():
    async def scenario():
        order = StepOrder()
        with pytest.raises(DeadlineExceeded):
            await order.after_optimizer_step(1, SHORT)
        waiter = asyncio.create_task(order.after_optimizer_step(1, LONG))
        await asyncio.sleep(0)
        await order.optimizer_step_settled(1)
        await waiter
    run(scenario())


def test_backward_failures_waits_for_every_outcome_and_returns_the_failures():
    async def scenario():
        order = StepOrder()
        waiter = asyncio.create_task(order.backward_failures([1, 2, 3], LONG))
        await order.backward_finished(1)
        await order.backward_finished(2, "stage 2: residual 'res_1' did not arrive")
        assert await is_waiting(waiter)
        await order.backward_finished(3)
        return await waiter
    assert run(scenario()) == {2: "stage 2: residual 'res_1' did not arrive"}


def test_backward_failures_of_successful_steps_is_empty():
    async def scenario():
        order = StepOrder()
        await order.backward_finished(1)
        await order.backward_finished(2)
        return await order.backward_failures([1, 2], SHORT)
    assert run(scenario()) == {}


def test_backward_failures_of_no_steps_is_empty_at_once():
    assert run(StepOrder().backward_failures([], SHORT)) == {}


def test_backwards_lost_with_a_broken_link_fail_the_steps_sent_on_it_and_no_later_ones():
    async def scenario():
        order = StepOrder()
        await order.backward_finished(1)
        waiter = asyncio.create_task(order.backward_failures([1, 2, 3], LONG))
        assert await is_waiting(waiter)
        await order.backwards_lost(2, "shard at b is unavailable")
        assert await is_waiting(waiter), "step 3 went out after the break: its backward may still come"
        await order.backward_finished(3)
        return await waiter
    assert run(scenario()) == {2: "shard at b is unavailable"}


def test_no_backward_counts_as_lost_before_a_link_broke_not_even_step_zeros():
    with pytest.raises(DeadlineExceeded):
        run(StepOrder().backward_failures([0], SHORT))


def test_backward_failures_times_out_naming_the_steps():
    async def scenario():
        order = StepOrder()
        await order.backward_finished(1)
        await order.backward_failures([1, 2], SHORT)
    with pytest.raises(DeadlineExceeded, match=re.escape("backward of steps [1, 2] did not happen within 0.01 s")):
        run(scenario())


def test_forget_drops_outcomes_up_to_the_step():
    async def scenario():
        order = StepOrder()
        for step in (1, 2, 3):
            await order.backward_finished(step, f"failed {step}")
        order.forget(2)
        for step in (1, 2):
            with pytest.raises(DeadlineExceeded):
                await order.backward_failures([step], SHORT)
        return await order.backward_failures([3], SHORT)
    assert run(scenario()) == {3: "failed 3"}
