"""Starting a coroutine eagerly: it runs at once, in the caller's turn of the event loop, until it first waits.

Python 3.12's eager tasks do the same (asyncio.eager_task_factory); this works on 3.11 too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def start(coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
    """Runs `coroutine` now until it first waits, then as a Task; None if it finished without waiting.

    What it raises before it first waits is raised here.
    """
    try:
        waiting_on = coroutine.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_resume(coroutine, waiting_on))


async def _resume(coroutine: Coroutine[Any, Any, Any], waiting_on: Any) -> Any:
    """Drives a started coroutine as a Task would: resumes it each time what it waits on is done."""
    while True:
        try:
            if waiting_on is None:
                await asyncio.sleep(0)  # a bare yield: the coroutine gives up one turn of the loop
            else:
                waiting_on._asyncio_future_blocking = False
                await asyncio.wait((waiting_on,))
        except asyncio.CancelledError as cancelled:
            if waiting_on is not None:
                waiting_on.cancel()  # as a Task cancels what its coroutine waits on
            step = coroutine.throw
            argument: Any = cancelled
        else:
            step, argument = coroutine.send, None
        try:
            waiting_on = step(argument)
        except StopIteration as finished:
            return finished.value
