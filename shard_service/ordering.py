"""Orders the work a client sends without waiting for answers: forwards after optimizer steps, steps after backwards."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from shardtrain.errors import DeadlineExceeded
from shardtrain.waiting import settled_within


class StepOrder:
    """What this shard has settled so far, and waits (with timeouts) for what has not settled yet."""

    def __init__(self) -> None:
        self._waiting: list[tuple[Callable[[], bool], asyncio.Future]] = []  # (condition, its waiter)
        self._optimizer_steps = 0           # highest optimizer step settled here (applied or refused)
        self._backwards: dict[int, str] = {}  # step -> "" if its backward succeeded here and upstream, else why not
        self._lost_up_to, self._lost_reason = -1, ""  # backwards without an outcome up to this step never come

    async def _wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        if predicate():
            return  # the usual case: no future, no timer
        waiter = asyncio.get_running_loop().create_future()
        entry = (predicate, waiter)
        self._waiting.append(entry)
        try:
            if not await settled_within(waiter, timeout):
                raise DeadlineExceeded(f"{what} did not happen within {timeout:g} s")
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)

    async def _notify(self) -> None:
        """Wakes the waits whose condition now holds (checked here, so a woken wait has nothing to re-check)."""
        for entry in [entry for entry in self._waiting if entry[0]()]:
            self._waiting.remove(entry)
            if not entry[1].done():
                entry[1].set_result(None)

    async def after_optimizer_step(self, number: int, timeout: float) -> None:
        """Returns once optimizer step `number` has settled here (at once for 0)."""
        await self._wait(lambda: self._optimizer_steps >= number, timeout, f"optimizer step {number}")

    async def optimizer_step_settled(self, number: int) -> None:
        """Records that optimizer step `number` is over here, applied or not."""
        self._optimizer_steps = max(self._optimizer_steps, number)
        await self._notify()

    async def backward_finished(self, step: int, failure: str = "") -> None:
        """Records the outcome of a step's backward: "" for success, else the reason."""
        self._backwards[step] = failure
        await self._notify()

    async def backwards_lost(self, up_to_step: int, reason: str) -> None:
        """Records that the backwards of steps up to `up_to_step` that have no outcome yet will not come (the link
        that brings them broke): they count as failed for `reason`."""
        if up_to_step > self._lost_up_to:
            self._lost_up_to, self._lost_reason = up_to_step, reason
            await self._notify()

    def _outcome(self, step: int) -> str | None:
        return self._backwards.get(step, self._lost_reason if step <= self._lost_up_to else None)

    async def backward_failures(self, steps: Iterable[int], timeout: float) -> dict[int, str]:
        """Waits until every listed backward has an outcome; returns the failed ones with their reasons."""
        steps = list(steps)
        await self._wait(lambda: all(self._outcome(s) is not None for s in steps), timeout,
                         f"backward of steps {steps}")
        return {s: self._outcome(s) for s in steps if self._outcome(s)}

    def forget(self, up_to_step: int) -> None:
        """Drops backward outcomes of steps up to `up_to_step`."""
        for step in [s for s in self._backwards if s <= up_to_step]:
            del self._backwards[step]
