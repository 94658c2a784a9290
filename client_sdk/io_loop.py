"""The SDK's asyncio loop: run by the calling thread in a script, on a thread of its own for notebooks and async code.

Why the caller's thread: in a script, every blocking call (model(x), loss.backward(), model.step())
used to hop to the SDK's I/O thread and back. A step of the PyTorch-shaped loop then cost the SDK's
process about 8 context switches against the floor driver's 1 (/proc's voluntary switches per step,
seed model at batch 32 on 3 local shards), and that process 1.5 ms of CPU against 0.5. Run by the
caller, the same step switched about 2 times, and `python -m bench.ab --model seed` timed a step
0.947x and 0.952x as long at 0.941x and 0.940x the CPU (10 and 12 rounds, faster in 9 of each).
A later A/B of this change together with the Ctrl-C handler below and a trim of Stage.forward
(`e41d21b` against `85da814`) gave 0.994x (faster in 6 of 12): a gain of about 5% is at the edge
of what that host resolves.

The loop needs a thread of its own once someone cannot lend theirs: a caller whose thread already
runs an event loop (a Jupyter kernel: the sync API there too), and the async API (aforward...), whose
awaitables belong to the caller's loop. From then on every call goes to that thread, as it always
did before. Callers on several threads take turns running the loop until then.

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
        # asyncio.Runner runs a script's calls: as asyncio.run does, Ctrl-C cancels the call's task at an
        # await rather than raising wherever the main thread is, which may be the middle of a loop callback
        # (a local link's read callback with half a frame cut would leave that link unreadable).
        self._runner = asyncio.Runner(loop_factory=ParkedClockLoop)
        self._loop: ParkedClockLoop = self._runner.get_loop()
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
        self._loop.unpark()
        try:
            return self._runner.run(coroutine)
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
