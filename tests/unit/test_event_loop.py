"""client_sdk.event_loop: coroutines run in a script's own thread, or on the SDK's thread for callers' event loops."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from client_sdk.event_loop import IoLoop
from shardtrain.waiting import settled_within


@pytest.fixture
def io():
    return IoLoop()


async def thread_name() -> str:
    return threading.current_thread().name


def test_a_script_runs_the_coroutine_in_its_own_thread_whether_it_waits_or_not(io):
    async def after_a_wait():
        await asyncio.sleep(0.01)
        return "waited"
    assert io.run(thread_name()) == threading.current_thread().name
    assert io.run(after_a_wait()) == "waited"
    assert not io.threaded


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


def make_threaded(io: IoLoop) -> None:
    """What a caller with a running loop does: from then on the loop runs on the SDK's thread."""
    async def caller():
        return await io.wrap(thread_name())
    assert asyncio.run(caller()) == "shardtrain-io"


@pytest.mark.parametrize("threaded", [False, True])
def test_run_from_the_loops_own_thread_is_refused(io, threaded):
    if threaded:
        make_threaded(io)

    async def nested():
        io.run(asyncio.sleep(0))
    with pytest.raises(RuntimeError, match="own thread"):
        io.run(nested())
    assert io.run(thread_name()) == ("shardtrain-io" if threaded else threading.current_thread().name)


def test_a_caller_with_a_running_loop_gets_the_sdks_thread_for_good(io):
    async def caller():
        return io.run(thread_name())  # the sync API inside a running loop, as in a Jupyter cell
    assert asyncio.run(caller()) == "shardtrain-io"
    assert io.threaded
    assert io.run(thread_name()) == "shardtrain-io", "every later call goes there too"


def test_work_left_waiting_goes_on_at_the_next_call_and_its_deadline_counts_only_the_calls(io):
    async def start():
        future = asyncio.get_running_loop().create_future()
        return future, asyncio.ensure_future(settled_within(future, 0.3))

    async def finish(future, waiting):
        future.set_result("arrived")
        return await waiting
    future, waiting = io.run(start())
    time.sleep(0.5)  # the script's own work, longer than the deadline: the loop's clock stands still
    assert io.run(finish(future, waiting)) is True


def test_callers_on_several_threads_take_turns(io):
    results = []

    async def slow(tag):
        await asyncio.sleep(0.05)
        return tag
    threads = [threading.Thread(target=lambda tag=tag: results.append(io.run(slow(tag)))) for tag in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(results) == [0, 1, 2, 3]


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


def test_ctrl_c_while_the_loop_runs_a_callback_ends_the_call_at_an_await_and_the_loop_stays_whole(io):
    """A script's Ctrl-C lands wherever its main thread is. In the loop's middle (a socket's read callback
    cutting frames, say) it must not cut that callback short: the call ends at an await instead."""
    finished = []

    async def interrupted():
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def read_callback():
            signal.raise_signal(signal.SIGINT)
            finished.append("the callback ran to its end")
            future.set_result(None)
        loop.call_soon(read_callback)
        await future
        await asyncio.sleep(30)  # the interrupt ends the call here, not after this
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        io.run(interrupted())
    assert finished == ["the callback ran to its end"]
    assert time.monotonic() - started < 10
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the script's own handler is back"
    assert io.run(thread_name()) == threading.current_thread().name, "the loop goes on serving"


def test_a_sigint_handler_of_the_scripts_own_is_left_alone(io):
    seen = []
    previous = signal.signal(signal.SIGINT, lambda *args: seen.append("the script's handler"))
    try:
        async def interrupted():
            signal.raise_signal(signal.SIGINT)
            await asyncio.sleep(0)
            return "went on"
        assert io.run(interrupted()) == "went on"
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == ["the script's handler"]


def test_a_call_never_formats_its_task_or_result(io):
    """asyncio.Runner.run, which also cancels at an await on Ctrl-C, formatted every finished call's task,
    result included, through signal.getsignal(): about 0.8 ms of CPU a call for a tensor result."""
    formatted = []

    class Result:
        def __repr__(self):
            formatted.append("repr")
            return "Result()"

    async def call():
        await asyncio.sleep(0)
        return Result()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert isinstance(io.run(call()), Result)
    assert formatted == []
