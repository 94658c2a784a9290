"""Calls the SDK has sent but not yet seen finish: their errors surface at the next call into the model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class InFlight:
    """Two generations of pending calls: this training iteration's and the previous one's.

    step() waits for the previous iteration only, so the client runs at most one iteration ahead
    of the shards and an error is reported at most one iteration after it happened.
    """

    def __init__(self, on_failure: Callable[[], None] = lambda: None) -> None:
        self._current: list[asyncio.Future] = []
        self._previous: list[asyncio.Future] = []
        self._on_failure = on_failure

    def add(self, call: asyncio.Future) -> None:
        """Tracks a call of the current iteration."""
        self._current.append(call)

    def raise_failures(self) -> None:
        """Raises the error of the first finished call that failed (cancelling the rest)."""
        for call in self._previous + self._current:
            if call.done() and not call.cancelled() and call.exception() is not None:
                self._cancel_all()
                raise call.exception()

    async def drain_previous(self) -> None:
        """Waits for the previous iteration's calls; raises the first error."""
        await self._drain(self._previous)
        self._previous = []

    def next_iteration(self) -> None:
        """The current iteration's calls become the previous one's."""
        self._previous, self._current = self._previous + self._current, []

    async def drain(self) -> None:
        """Waits for every call; raises the first error."""
        await self._drain(self._previous + self._current)
        self._previous, self._current = [], []

    async def _drain(self, calls: list[asyncio.Future]) -> None:
        try:
            for call in calls:
                await call
        except BaseException:
            self._cancel_all()
            raise

    def abandon(self) -> None:
        """Lets go of every call: pending ones are cancelled, and the errors of failed ones count as seen (one of
        them was raised, or their deployment was replaced)."""
        for call in self._previous + self._current:
            let_go(call)
        self._previous, self._current = [], []

    def _cancel_all(self) -> None:
        self.abandon()
        self._on_failure()


def let_go(call: asyncio.Future) -> None:
    """Cancels `call` if it is pending; if it failed, its error counts as seen (asyncio logs one nobody read)."""
    if call.done() and not call.cancelled():
        call.exception()
    else:
        call.cancel()
