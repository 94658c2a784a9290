"""shardtrain.waiting: a deadline on a future without cancelling it."""

from __future__ import annotations

import asyncio

from shardtrain.waiting import settled_within


def test_a_future_done_in_time_is_settled():
    async def scenario():
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, future.set_result, 7)
        return await settled_within(future, 5.0), future.result()
    assert asyncio.run(scenario()) == (True, 7)


def test_a_timeout_leaves_the_future_alone_for_other_waiters():
    async def scenario():
        future = asyncio.get_running_loop().create_future()
        late = await settled_within(future, 0.01)
        future.set_result("later")  # still pending, never cancelled: someone else may get it
        return late, await settled_within(future, 0.01), future.result()
    assert asyncio.run(scenario()) == (False, True, "later")


def test_a_cancelled_wait_removes_its_callback_and_cancels_its_timer():
    async def scenario():
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        waiting = asyncio.ensure_future(settled_within(future, 60.0))
        await asyncio.sleep(0)
        armed = [handle for handle in loop._scheduled if not handle.cancelled()]
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return waiting.cancelled(), future.cancelled(), armed, future._callbacks
    cancelled, future_cancelled, armed, callbacks = asyncio.run(scenario())
    assert cancelled and not future_cancelled, "cancelling the wait does not cancel what it waited for"
    assert len(armed) == 1 and armed[0].cancelled(), "the 60 s timer was armed, then cancelled"
    assert not callbacks, "the future no longer calls back into the finished wait"
