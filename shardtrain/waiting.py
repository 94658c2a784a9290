"""Waiting for a future with a deadline, at the cost of one timer.

`asyncio.wait_for(asyncio.shield(future), timeout)` does the same with an extra future and
three more callbacks, each a turn of the event loop; on the loop's hot path a shard and the SDK
wait like this several times a step.
"""

from __future__ import annotations

import asyncio


async def settled_within(future: asyncio.Future, timeout: float) -> bool:
    """Waits until `future` is done or `timeout` seconds have passed; True if it is done. The future is
    left alone either way (never cancelled), so others may go on waiting for it."""
    if future.done():
        return True
    waiter = asyncio.get_running_loop().create_future()

    def wake(_=None) -> None:
        if not waiter.done():
            waiter.set_result(None)
    timer = asyncio.get_running_loop().call_later(timeout, wake)
    future.add_done_callback(wake)
    try:
        await waiter
    finally:
        timer.cancel()
        future.remove_done_callback(wake)
    return future.done()
