"""A shard's event loop polls its sockets for a short window after each event before it sleeps.

Why: an item that reaches a sleeping shard wakes a process whose core may have gone idle, and on the
2-core development VM the code that runs first after such a wake-up is several times slower than
the same code run warm (its caches and the idle vCPU's state are gone). `packed.unpack` of a small
item took 7 us warm, 14-24 us after a 1 ms sleep and 41-64 us after a 5 ms sleep, and 13 us after a
5 ms sleep while idle-class spinners kept both vCPUs from halting (one process, medians of 300). A
shard runs about a dozen such items a step, each through a few hundred lines of Python, so its
hand-offs paid this on the critical path. A shard that is still polling when the next item comes
takes it at once, warm. Seed model at batch 32 on 3 local shards, stages polling 0 / 0.3 / 1 / 2 /
3 / 10 ms (two runs of alternating rounds of 150 steps, one cluster each, medians of the per-round
ratios): a step took 0.991x (0.3 ms, faster in 5 of 6 rounds), 0.943x and 0.972x (1 ms: 8 of 8 and
4 of 6), 0.980x (2 ms), 0.950x (3 ms) and 0.931x (10 ms) as long as without polling, for 1.4, 3.0-3.1,
4.4, 5.0 and 5.4 ms more CPU a step (on 12.6-12.9, all four processes). The floor's stages
(bench/floor.py), whose per-item code is a few lines, gained nothing from it (1 ms: 1.006x), and the
SDK's loop, which waits for a whole forward, lost: polling 5 ms there made the step 1.17x as long,
its CPU taken from the stages.

TensorPipe, under torch.distributed.rpc, busy-polls its shared-memory transport the same way, and so
do MPI and NCCL. The cost is CPU: up to `window` seconds of it after each event, given up to any
other runnable thread on the core at every poll (sched_yield), and none once the shard is idle.

While the shard's compute thread runs stage work (work too long to run on the loop itself), the loop
does not poll: each poll takes the GIL, which that thread needs between its torch calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import time
from collections.abc import Iterator


class PollingSelector(selectors.DefaultSelector):
    """A selector that, asked to wait, first polls without blocking for up to `window` seconds."""

    def __init__(self, window: float):
        super().__init__()
        if window < 0:
            raise ValueError(f"a polling window is at least 0 seconds, got {window}")
        self.window = window
        self._held = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No polling inside: another thread of this process needs the GIL meanwhile."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1

    def select(self, timeout: float | None = None) -> list:
        if self._held or self.window <= 0 or (timeout is not None and timeout <= 0):
            return super().select(timeout)
        start = time.monotonic()
        until = start + (self.window if timeout is None else min(self.window, timeout))
        while True:
            ready = super().select(0)
            if ready:
                return ready
            if time.monotonic() >= until:
                break
            os.sched_yield()  # another runnable thread on this core goes first
        if timeout is None:
            return super().select(None)
        return super().select(max(0.0, timeout - (time.monotonic() - start)))


class PollingLoop(asyncio.SelectorEventLoop):
    """An event loop on a PollingSelector."""

    def __init__(self, window: float):
        self.polling = PollingSelector(window)
        super().__init__(self.polling)


def held(loop: asyncio.AbstractEventLoop) -> contextlib.AbstractContextManager:
    """`loop`'s PollingSelector.held(); nothing to hold for a loop that does not poll."""
    return loop.polling.held() if isinstance(loop, PollingLoop) else contextlib.nullcontext()
