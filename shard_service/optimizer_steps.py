"""An optimizer step on a stage: passed down the stages at once, and applied by each after its own share of the
backwards it follows, unless one of them failed there or on a stage before. The stages' weights never drift
apart, and stage i+1 starts its optimizer while stage i runs its own. A Flush follows the same way."""

from __future__ import annotations

import time
from collections.abc import Callable

from shard_service.ordering import StepOrder
from shard_service.sends import StageSends
from shard_service.tied import TiedGradients
from shard_service.verdicts import Verdicts
from shardtrain import errors, link_streams
from shardtrain.v1 import shard_pb2

STATS_KEPT = 8  # the StageStats of the last planned steps, for a Flush that asks for them


class OptimizerSteps:
    """The step items and flushes of one stage for one deployment. `run_of` gives the planned run of a step, if
    any, whose figures a Flush may ask for."""

    def __init__(self, shard, sends: StageSends, tied: TiedGradients, verdicts: Verdicts,
                 run_of: Callable[[int], object]):
        self._shard, self._sends, self._tied, self._verdicts = shard, sends, tied, verdicts
        self._run_of = run_of
        self._stats: dict[int, shard_pb2.StageStats] = {}  # optimizer step -> what its planned step did here

    async def step(self, item: shard_pb2.LinkStep) -> str:
        """Passes an optimizer step on once this stage's share of its backwards is over, then applies it
        unless one of them failed here or on a stage before; returns why it was refused ("" if it was not).
        The step keeps its deployment's StepOrder: a LoadStage puts in a new one, then ends this step mid-way."""
        request, order = item.request, self._shard.order
        stage, failure = await self._verdict(request, item.failure, order)
        if self._shard.plan.next_address:
            verdict = shard_pb2.LinkMessage(step=shard_pb2.LinkStep(request=request, failure=failure))
            self._verdicts.passed_down(verdict)
            await self._sends.pass_down(verdict)
        await self._apply(stage, request, failure, order)
        return failure

    async def _verdict(self, request: shard_pb2.StepRequest, failure: str,
                       order: StepOrder) -> tuple[object | None, str]:
        """Once this stage's backwards of the step are over: the stage, and why the step is refused ("" if it is
        not; a reason from a stage before wins)."""
        shard = self._shard
        try:
            stage = shard.stage_for(request.deployment_id)
            failures = await order.backward_failures(request.backward_steps, shard.settings.timeouts.peer_wait)
        except Exception as error:  # noqa: BLE001 - the step is refused on this stage and those after it
            return None, failure or errors.located_message(error, shard.location)
        if failures and not failure:
            step, reason = next(iter(failures.items()))
            failure = f"the backward of step {step} failed: {reason}"
        return stage, failure

    async def _apply(self, stage, request: shard_pb2.StepRequest, failure: str, order: StepOrder) -> None:
        """Applies the step unless it was refused; either way it counts as settled in `order` (its deployment's),
        and the step's state goes. Settled in a later deployment's order, it would let that deployment's forwards
        run before their own optimizer steps of the same numbers."""
        shard = self._shard
        try:
            if stage is not None and request.hyperparameters_json:  # in force from this step on, applied or not
                await shard.run(stage.weights.set_hyperparameters, request.hyperparameters_json)
            if stage is not None and not failure:
                await self._optimize(stage, request)
            else:
                shard.steps.clear()
        except Exception as error:  # noqa: BLE001 - this stage's optimizer failed: the SDK hears of it
            item = link_streams.error_item(None, error, shard.location, optimizer_step=request.optimizer_step)
            await self._sends.tell(item, up=False)
        finally:
            await order.optimizer_step_settled(request.optimizer_step)
            if stage is not None:
                await shard.forget(stage, request.step)

    async def _optimize(self, stage, request: shard_pb2.StepRequest) -> None:
        shard = self._shard
        if request.zero_grad:
            await shard.run(stage.weights.zero_grad)
        await self._tied.sum(stage, request.optimizer_step)
        started = time.perf_counter()
        await shard.run(stage.weights.step, request.gradient_scale, request.optimizer_step, request.skip,
                        request.gradient_edits)
        self._record_stats(request, time.perf_counter() - started)
        shard.steps.stepped()

    def _record_stats(self, request: shard_pb2.StepRequest, optimizer_seconds: float) -> None:
        """Keeps what the planned step this optimizer step ends did here, for a Flush that asks."""
        run = self._run_of(request.step)
        if run is None or not run.done:
            return
        plan = self._shard.plan
        self._stats[request.optimizer_step] = run.figures.stats(plan.stage, plan.replica, optimizer_seconds)
        while len(self._stats) > STATS_KEPT:
            del self._stats[min(self._stats)]

    async def flush(self, flush: shard_pb2.Flush) -> None:
        """Passes a Flush on (the last stage: back to the SDK) once its optimizer step settled here, with this
        stage's figures if it asks for them."""
        try:
            await self._shard.order.after_optimizer_step(flush.optimizer_step,
                                                           self._shard.settings.timeouts.peer_wait)
        except errors.ShardtrainError as error:
            item = link_streams.error_item(None, error, self._shard.location, optimizer_step=flush.optimizer_step)
            await self._sends.tell(item, up=False)
            return
        if flush.stats and flush.optimizer_step in self._stats:
            flush.stage_stats.append(self._stats[flush.optimizer_step])
        await self._sends.pass_down(shard_pb2.LinkMessage(flush=flush))
