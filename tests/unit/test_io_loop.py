"""client_sdk.io_loop: coroutines run on the SDK's own thread, for blocking callers and for callers' event loops."""

from __future__ import annotations

import asyncio
import threading

import pytest

from client_sdk.io_loop import IoLoop


@pytest.fixture(scope="module")
def io():
    return IoLoop()


def test_run_returns_what_the_coroutine_returns_whether_it_waits_or_not(io):
    async def at_once():
        return threading.current_thread().name

    async def after_a_wait():
        await asyncio.sleep(0.01)
        return "waited"
    assert io.run(at_once()) == "shardtrain-io", "the coroutine runs on the SDK's thread"
    assert io.run(after_a_wait()) == "waited"


def test_run_raises_what_the_coroutine_raises_before_or_after_waiting(io):
    async def at_once():
        raise ValueError("before")

    async def after_a_wait():
        await asyncio.sleep(0.01)
        raise KeyError("after")
    with pytest.raises(ValueError, match="before"):
        io.run(at_once())
    with pytest.raises(KeyError, match="after"):
        io.run(after_a_wait())


def test_run_from_the_loops_own_thread_is_refused(io):
    async def nested():
        inner = asyncio.sleep(0)
        try:
            io.run(inner)
        finally:
            inner.close()
    with pytest.raises(RuntimeError, match="own thread"):
        io.run(nested())


def test_wrap_serves_a_callers_running_loop_and_its_cancellation_reaches_the_work(io):
    seen = []

    async def work():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled on the SDK's thread")
            raise

    async def caller():
        value = await io.wrap(asyncio.sleep(0, "ok"))
        waiting = asyncio.ensure_future(io.wrap(work()))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        return value
    assert asyncio.run(caller()) == "ok"
    assert seen == ["cancelled on the SDK's thread"]
