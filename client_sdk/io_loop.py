"""A private asyncio loop on a daemon thread: the SDK's RPCs run there, so it works in scripts and notebooks alike."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

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
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def wrap(self, coroutine: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """An awaitable for the caller's running loop (for example a Jupyter kernel's)."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))


_shared: IoLoop | None = None
_lock = threading.Lock()


def shared_loop() -> IoLoop:
    """The one IoLoop of this process, started on first use."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = IoLoop()
        return _shared
