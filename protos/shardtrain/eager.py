"""Starting a coroutine at once, in the caller's turn of the event loop, instead of in a later one.

`asyncio.ensure_future(work())` runs nothing of `work` now: its first step waits for the loop's next
turn, after the loop has polled its sockets again. On a link's hot path the work an item starts
usually never waits at all (its inputs are there, the stage is free, the socket takes the result),
so a task per item costs a Task, a turn of the loop and the select() before it, for nothing.
`start(work())` runs the work up to its first real wait; only what is left becomes a task. (Python
3.12's eager task factory does the same; this project runs on 3.11.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any


def start(coroutine: Coroutine[Any, Any, Any]) -> asyncio.Future:
    """Like `asyncio.ensure_future(coroutine)`, except that the coroutine runs now until it first waits for
    something not yet done; what is left of it runs as a task. The returned future is that task, or (if
    the coroutine ended without waiting) a future already done with its result or exception.

    Unlike in a task, code in that first part sees the caller's task as asyncio.current_task().
    """
    loop = asyncio.get_running_loop()
    try:
        pending = coroutine.send(None)
    except StopIteration as stop:
        return _done(loop, stop.value)
    except asyncio.CancelledError:
        done = loop.create_future()
        done.cancel()
        return done
    except Exception as error:  # noqa: BLE001 - the future carries it, as a task would
        return _done(loop, error=error)
    return asyncio.ensure_future(_rest(_Resumed(coroutine, pending)))


def _done(loop: asyncio.AbstractEventLoop, value: Any = None, error: BaseException | None = None) -> asyncio.Future:
    done = loop.create_future()
    if error is None:
        done.set_result(value)
    else:
        done.set_exception(error)
    return done


async def _rest(resumed: _Resumed) -> Any:
    return await resumed


class _Resumed:
    """A started coroutine, handed to a task where it stopped: what it waits for goes to the task, and
    what the task sends or throws (a woken wait, a cancellation) goes back into it, as if the task had
    run it from the start."""

    def __init__(self, coroutine: Coroutine[Any, Any, Any], pending: Any):
        self._coroutine, self._pending = coroutine, pending

    def __await__(self) -> Generator[Any, Any, Any]:
        pending = self._pending
        while True:
            try:
                sent = yield pending
            except BaseException as error:  # noqa: BLE001 - a cancellation, or a throw from the task: the coroutine's
                try:
                    pending = self._coroutine.throw(error)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    pending = self._coroutine.send(sent)
                except StopIteration as stop:
                    return stop.value
