"""client_sdk.inflight: calls sent without waiting, whose errors surface at the next call into the model."""

from __future__ import annotations

import asyncio

import pytest

from client_sdk.inflight import InFlight
from shardtrain.errors import FailedPrecondition, Unavailable


def run(coroutine):
    return asyncio.run(coroutine)


def future(result=None, error: Exception | None = None, done: bool = True) -> asyncio.Future:
    call = asyncio.get_running_loop().create_future()
    if done and error is not None:
        call.set_exception(error)
    elif done:
        call.set_result(result)
    return call


def test_raise_failures_is_quiet_while_nothing_failed():
    async def scenario():
        calls = InFlight()
        pending, finished = future(done=False), future("ok")
        calls.add(pending)
        calls.add(finished)
        calls.raise_failures()
        return pending.cancelled()
    assert run(scenario()) is False


def test_raise_failures_raises_the_first_failure_and_cancels_the_rest():
    async def scenario():
        calls = InFlight()
        pending = future(done=False)
        calls.add(pending)
        calls.add(future(error=Unavailable("shard 1 is unavailable")))
        with pytest.raises(Unavailable, match="shard 1 is unavailable"):
            calls.raise_failures()
        return pending.cancelled()
    assert run(scenario()) is True


def test_raise_failures_reports_the_previous_iteration_first():
    async def scenario():
        calls = InFlight()
        calls.add(future(error=FailedPrecondition("step 1 failed")))
        calls.next_iteration()
        calls.add(future(error=Unavailable("step 2 failed")))
        with pytest.raises(FailedPrecondition, match="step 1 failed"):
            calls.raise_failures()
    run(scenario())


def test_raise_failures_ignores_cancelled_calls():
    async def scenario():
        calls = InFlight()
        cancelled = future(done=False)
        cancelled.cancel()
        calls.add(cancelled)
        calls.raise_failures()
    run(scenario())


def test_errors_are_reported_once():
    async def scenario():
        calls = InFlight()
        calls.add(future(error=Unavailable("gone")))
        with pytest.raises(Unavailable):
            calls.raise_failures()
        calls.raise_failures()
        await calls.drain()
    run(scenario())


def test_drain_previous_waits_for_the_previous_iteration_only():
    async def scenario():
        calls = InFlight()
        previous = future(done=False)
        calls.add(previous)
        calls.next_iteration()
        current = future(done=False)
        calls.add(current)
        drain = asyncio.create_task(calls.drain_previous())
        await asyncio.sleep(0)
        assert not drain.done()
        previous.set_result("done")
        await drain  # returns although `current` is still pending
        return current.done()
    assert run(scenario()) is False


def test_drain_previous_raises_the_error_and_cancels_every_call():
    async def scenario():
        calls = InFlight()
        calls.add(future(error=FailedPrecondition("optimizer step 3 not applied")))
        calls.next_iteration()
        current = future(done=False)
        calls.add(current)
        with pytest.raises(FailedPrecondition, match="optimizer step 3 not applied"):
            await calls.drain_previous()
        return current.cancelled()
    assert run(scenario()) is True


def test_next_iteration_keeps_undrained_calls_in_previous():
    async def scenario():
        calls = InFlight()
        first = future(done=False)
        calls.add(first)
        calls.next_iteration()
        calls.next_iteration()
        drain = asyncio.create_task(calls.drain_previous())
        await asyncio.sleep(0)
        assert not drain.done()  # still waits for the call two iterations back
        first.set_result(None)
        await drain
    run(scenario())


def test_drain_waits_for_every_call():
    async def scenario():
        calls = InFlight()
        older, newer = future(done=False), future(done=False)
        calls.add(older)
        calls.next_iteration()
        calls.add(newer)
        drain = asyncio.create_task(calls.drain())
        older.set_result(1)
        await asyncio.sleep(0)
        assert not drain.done()
        newer.set_result(2)
        await drain
    run(scenario())


def test_drain_raises_the_first_error_and_cancels_the_rest():
    async def scenario():
        calls = InFlight()
        later = future(done=False)
        calls.add(future(error=Unavailable("shard 0 is unavailable")))
        calls.add(later)
        with pytest.raises(Unavailable, match="shard 0"):
            await calls.drain()
        assert later.cancelled()
        await calls.drain()  # nothing is left to wait for
    run(scenario())


def test_drain_of_nothing_returns_at_once():
    run(InFlight().drain())
