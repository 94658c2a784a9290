"""A private asyncio loop on a daemon thread: the SDK's RPCs run there, so it works in scripts and notebooks alike."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from shardtrain import eager

T = TypeVar("T")


class IoLoop:
    """Runs coroutines on its own thread; callers block on them or await them from their own loop."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="shardtrain-io", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine to completion and returns its result (blocks the calling thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("IoLoop.run called from its own thread; await the coroutine instead")
        return self._submit(coroutine).result()

    def wrap(self, coroutine: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """An awaitable for the caller's running loop (for example a Jupyter kernel's)."""
        return asyncio.wrap_future(self._submit(coroutine))

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future:
        """As asyncio.run_coroutine_threadsafe, but the coroutine starts in the turn of the loop that takes it
        (shardtrain.eager), and a result it has without waiting goes back to the caller at once, where a task
        would take two more turns. Cancelling the returned future cancels the work."""
        result: concurrent.futures.Future = concurrent.futures.Future()

        def begin() -> None:
            if result.cancelled():
                coroutine.close()
                return
            work = eager.start(coroutine)
            if work.done():
                _settle(result, work)
                return
            work.add_done_callback(lambda _: _settle(result, work))
            result.add_done_callback(lambda _: result.cancelled() and self._loop.call_soon_threadsafe(work.cancel))
        self._loop.call_soon_threadsafe(begin)
        return result


def _settle(result: concurrent.futures.Future, work: asyncio.Future) -> None:
    """Copies the work's outcome to the caller's future (left pending while the work runs, so that the caller
    can still cancel it)."""
    if work.cancelled():
        result.cancel()
    elif not result.set_running_or_notify_cancel():
        return  # the caller cancelled it
    elif work.exception() is not None:
        result.set_exception(work.exception())
    else:
        result.set_result(work.result())


_shared: IoLoop | None = None
_lock = threading.Lock()


def shared_loop() -> IoLoop:
    """The one IoLoop of this process, started on first use."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = IoLoop()
        return _shared
