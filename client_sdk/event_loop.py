"""The SDK's asyncio loop: run by the calling thread in a script, on a thread of its own for notebooks and async code.

Why the caller's thread: in a script every blocking call (model(x), loss.backward(), model.step()) would
otherwise hop to an I/O thread and back, several context switches a step that the caller's own thread
avoids (docs/performance.md has the figures).

The loop needs a thread of its own once someone cannot lend theirs: a caller whose thread already
runs an event loop (a Jupyter kernel: the sync API there too), and the async API (aforward...), whose
awaitables belong to the caller's loop. From then on every call goes to that thread. Callers on
several threads take turns running the loop until then.

Between a script's calls nobody runs the loop: items that arrive wait in their sockets. Its clock
stands still meanwhile (ParkedClockLoop), so a wait's deadline counts only the time the SDK was
waiting. Otherwise a script that spent two minutes on its own work between loss.backward() and
model.step() would find the backward's deadline expired before the loop read the item that ends it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from client_sdk.ctrl_c import CtrlC

T = TypeVar("T")


class ParkedClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock does not advance while it is parked (nobody runs it)."""

    def __init__(self) -> None:
        super().__init__()
        self._parked_for = 0.0                    # seconds spent parked so far
        self._parked_since: float | None = time.monotonic()

    def time(self) -> float:
        now = self._parked_since if self._parked_since is not None else time.monotonic()
        return now - self._parked_for

    def park(self) -> None:
        """Stops the clock (the loop is no longer run)."""
        self._parked_since = time.monotonic()

    def unpark(self) -> None:
        """Starts the clock again where it stopped."""
        if self._parked_since is not None:
            self._parked_for += time.monotonic() - self._parked_since
            self._parked_since = None


class IoLoop:
    """Runs the SDK's coroutines; callers block on them or await them from their own loop."""

    def __init__(self) -> None:
        self._loop = ParkedClockLoop()
        self._lock = threading.Lock()  # held by the caller that runs the loop, and while the thread starts
        self._thread: threading.Thread | None = None

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine to completion and returns its result (blocks the calling thread)."""
        running = _running_loop()
        if running is self._loop:
            coroutine.close()
            raise RuntimeError("IoLoop.run called from its own thread; await the coroutine instead")
        if running is None and self._thread is None:
            with self._lock:
                if self._thread is None:
                    return self._run_here(coroutine)
        self._start_thread()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def wrap(self, coroutine: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """An awaitable for the caller's running loop (for example a Jupyter kernel's)."""
        self._start_thread()
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    @property
    def threaded(self) -> bool:
        """Whether the loop runs on a thread of its own (from now on)."""
        return self._thread is not None

    def _run_here(self, coroutine: Coroutine[Any, Any, T]) -> T:
        task = self._loop.create_task(coroutine)
        self._loop.unpark()
        try:
            with _InterruptAtAnAwait(self._loop, task) as interrupt:
                try:
                    result = self._loop.run_until_complete(task)
                except asyncio.CancelledError:
                    if interrupt.fired:
                        raise KeyboardInterrupt from None
                    raise
                if interrupt.fired:  # it came as the call was ending: the call is complete, then interrupted
                    raise KeyboardInterrupt
                return result
        finally:
            self._loop.park()

    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        with self._lock:  # once no caller is running the loop
            if self._thread is None:
                self._loop.unpark()
                self._thread = threading.Thread(target=self._loop.run_forever, name="shardtrain-io", daemon=True)
                self._thread.start()


class _InterruptAtAnAwait(CtrlC):
    """While a script's main thread runs the loop, Ctrl-C cancels the call's task, as asyncio.run does.

    Python raises KeyboardInterrupt wherever the main thread is, and here that may be the middle of a
    loop callback: a local link's read callback with half a frame cut would leave that link unreadable.
    Cancelled at an await, the call ends with KeyboardInterrupt and the loop stays whole; one that comes as
    the call ends (its task done, the loop still running the callbacks ready with it) is raised once the call
    returns. A second Ctrl-C raises at once. A SIGINT handler of the script's own is left alone.

    Not asyncio.Runner.run, which does the same: after each call it asks signal.getsignal() whether its
    handler is still installed, and getsignal() turns a handler that is not a signal.Handlers member into
    one by trying Handlers(handler), whose ValueError formats repr(handler). Runner's handler is a partial
    holding the call's task, so every call formatted the finished task, its result tensor included, which
    cost far more than the call's own work. The handler here is a bound method of an object with a
    constant repr (CtrlC).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task):
        super().__init__()
        self._loop, self._task = loop, task

    def on_interrupt(self, signum, frame) -> None:
        super().on_interrupt(signum, frame)
        # A call whose task is done may still be running the loop's other callbacks (a send it started): raised
        # in one of those, the interrupt would be stored in that task and raised again by whatever awaits it.
        self._task.cancel()
        self._loop.call_soon_threadsafe(lambda: None)  # wakes the selector if it sleeps


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


_shared: IoLoop | None = None
_lock = threading.Lock()


def shared_loop() -> IoLoop:
    """The one IoLoop of this process, made on first use."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = IoLoop()
        return _shared
