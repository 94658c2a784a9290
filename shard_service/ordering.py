"""The waits of a deployment's order on the event loop: the runtime (runtime.py) decides what has settled and
answers a Wait for what has not; here the caller is parked on a future until the runtime says Ready, or the wait's
deadline passes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from shard_service.runtime import DeploymentRuntime, Ready, Wait
from shardtrain.waiting import settled_within


class StepOrder:
    """Forwards after their optimizer steps, optimizer steps after their backwards: `runtime`'s answers (a
    deployment's of its own if none is given), waited for with deadlines."""

    def __init__(self, runtime: DeploymentRuntime | None = None) -> None:
        self.runtime = runtime if runtime is not None else DeploymentRuntime()
        self._parked: dict[int, asyncio.Future] = {}  # wait id -> its caller's future

    async def _wait(self, wait: Wait | None, timeout: float) -> None:
        if wait is None:
            return  # the usual case: no future, no timer
        parked = self._parked[wait.id] = asyncio.get_running_loop().create_future()
        try:
            if not await settled_within(parked, timeout):
                raise self.runtime.deadline_passed(wait, timeout)
        finally:
            if self._parked.pop(wait.id, None) is not None and not parked.done():
                self.runtime.gave_up(wait)

    def _wake(self, ready: list[Ready]) -> None:
        for answer in ready:
            parked = self._parked.pop(answer.id, None)
            if parked is not None and not parked.done():
                parked.set_result(None)

    async def after_optimizer_step(self, number: int, timeout: float) -> None:
        """Returns once optimizer step `number` has settled here (at once for 0)."""
        await self._wait(self.runtime.after_optimizer_step(number), timeout)

    async def optimizer_step_settled(self, number: int) -> None:
        """Records that optimizer step `number` is over here, applied or not."""
        self._wake(self.runtime.optimizer_step_settled(number))

    async def backward_finished(self, step: int, failure: str = "") -> None:
        """Records the outcome of a step's backward: "" for success, else the reason."""
        self._wake(self.runtime.backward_finished(step, failure))

    async def backwards_lost(self, up_to_step: int, reason: str) -> None:
        """Records that the backwards of steps up to `up_to_step` that have no outcome yet will not come."""
        self._wake(self.runtime.backwards_lost(up_to_step, reason))

    async def backward_failures(self, steps: Iterable[int], timeout: float) -> dict[int, str]:
        """Waits until every listed backward has an outcome; returns the failed ones with their reasons."""
        steps = list(steps)
        await self._wait(self.runtime.after_backwards(steps), timeout)
        return self.runtime.backward_failures(steps)

    def stages_after_finished(self, step: int, failure: str = "") -> None:
        """Records that the stages after this one finished planned step `step` ("") or failed it (why)."""
        self._wake(self.runtime.stages_after_finished(step, failure))

    def next_link_broke(self, reason: str) -> None:
        """Records that the link to the next stage broke: the steps under way hear no more from below."""
        self._wake(self.runtime.next_link_broke(reason))

    async def stages_after(self, step: int, timeout: float) -> str:
        """Waits until the stages after this one finished planned step `step` ("") or failed it; returns why."""
        await self._wait(self.runtime.after_stages_after(step), timeout)
        return self.runtime.stages_after_outcome(step)

    def forget(self, up_to_step: int) -> None:
        """Drops what the runtime keeps of steps up to `up_to_step`."""
        self.runtime.forget(up_to_step)
