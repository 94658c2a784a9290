"""The planned steps (model.train_step) of one stage for one deployment: each step's run (planned_run.py) is started by
the step's first item; its micro-batches' items and the last stage's loss targets are delivered to it, and its end
or failure is told to the stages around it and settles its backward here."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from shard_service.executor import StageExecutor
from shard_service.held import tensor_bytes
from shard_service.mailbox import Mailbox
from shard_service.planned_run import PlannedRun
from shardtrain import errors, link_streams
from shardtrain.v1 import shard_pb2


class PlannedRuns:
    """The planned runs of one stage, by step. `spawn` runs a coroutine as the loop's task and returns it."""

    def __init__(self, executor: StageExecutor, spawn: Callable[..., asyncio.Task]):
        self._executor, self._shard, self._spawn = executor, executor.shard, spawn
        self._sends, self._links = executor.sends, executor.sends.links
        self._runs: dict[int, PlannedRun] = {}
        self._targets = Mailbox(held=executor.held)  # last stage: loss targets, by (step, microbatch)

    def __contains__(self, step: int) -> bool:
        return step in self._runs

    def run_of(self, step: int) -> PlannedRun | None:
        """The run of planned step `step`, if it is held here."""
        return self._runs.get(step)

    def item(self, key: shard_pb2.StepKey, item: tuple, backward: bool) -> None:
        """A micro-batch's forward or backward of a planned step, for its run (started by the step's first item)."""
        try:
            run = self._runs.get(key.step)
            if run is None:
                run = self._start(key, item[0].plan)
            if run.aborted:
                return  # the step failed; its other items are dropped
            run.deliver(key.microbatch, "backward" if backward else "forward", item)
        except errors.ShardtrainError as error:
            if key.step not in self._runs and key.step > self._executor.forwarded:
                # The step could not start here (its plan was refused): its backward will never run, so its
                # optimizer step must be refused here rather than wait for it.
                self._spawn(self._shard.order.backward_finished(key.step, str(error)))
            self._spawn(self._sends.report(key, error, backward))

    def _start(self, key: shard_pb2.StepKey, plan: shard_pb2.StepPlan) -> PlannedRun:
        self._shard.stage_for(key.deployment_id)
        run = PlannedRun(self._executor, key.step, plan, self._targets)
        self._runs[key.step] = run
        run.task = self._spawn(self._execute(run))
        return run

    def target(self, end: link_streams.LinkEnd, target: shard_pb2.LossTarget, tensor: torch.Tensor | None) -> None:
        """A micro-batch's loss target, from the SDK to the last stage."""
        key = target.key
        try:
            if end is not self._links.output:
                raise errors.InvalidArgument("loss targets come from the SDK's output link to the last stage")
            if (tensor is None) != bool(target.loss.model_output):
                raise errors.InvalidArgument("a target item carries the target tensor, unless its loss is the model's "
                                             "own output (LossSpec.model_output), and then none")
            self._targets.put((key.step, key.microbatch), (target, tensor), tensor_bytes(tensor))
        except errors.ShardtrainError as error:
            self._spawn(self._sends.report(key, error, backward=False))

    async def _execute(self, run: PlannedRun) -> None:
        """Runs a planned step's actions; a failure goes both ways (the stages before wait for gradients, those
        after for activations), and the step's backward counts as failed here, so no stage applies its step."""
        try:
            await run.execute()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - reported; the step's optimizer step is refused everywhere
            await self._failed(run, error)
            return
        run.done = True
        plan = self._shard.plan
        replicated = plan.num_replicas > 1
        # Replicated: the step is over here once it is over on every stage after this one too (run_done).
        failure = await self._runs_after(run.step) if replicated and plan.next_address else ""
        await self._shard.order.backward_finished(run.step, failure)
        if replicated and plan.stage > 0 and not failure:
            key = shard_pb2.StepKey(deployment_id=self._links.deployment_id, step=run.step)
            await self._links.send(self._links.up(run.step),
                                   shard_pb2.LinkMessage(run_done=shard_pb2.TensorKey(key=key)))

    async def _failed(self, run: PlannedRun, error: Exception) -> None:
        run.abort()
        key = shard_pb2.StepKey(deployment_id=self._links.deployment_id, step=run.step)
        location = self._shard.location
        await self._sends.tell(link_streams.error_item(key, error, location, backward=True), up=True, either_way=False)
        await self._sends.tell(link_streams.error_item(key, error, location), up=False, either_way=False)
        await self._shard.order.backward_finished(run.step, errors.located_message(error, location))

    def after_run(self, step: int, failure: str) -> None:
        """The stages after this one finished planned step `step` ("") or failed it (why); the first word counts."""
        self._shard.order.stages_after_finished(step, failure)

    def next_link_broke(self, reason: str) -> None:
        """The link to the next stage broke: no run_done comes back on it for the steps under way."""
        self._shard.order.next_link_broke(reason)

    async def _runs_after(self, step: int) -> str:
        """Why the stages after this one failed planned step `step`, or "" once they all finished it."""
        try:
            return await self._shard.order.stages_after(step, self._shard.settings.timeouts.peer_wait)
        except errors.ShardtrainError as error:
            return str(error)

    def abort(self, step: int, reason: str) -> bool:
        """Ends a planned step that failed on another stage; False if there is none running here."""
        run = self._runs.get(step)
        if run is None or run.done or run.aborted:
            return False
        run.abort()
        if run.task is not None:
            run.task.cancel()
        self._spawn(self._shard.order.backward_finished(step, reason))
        return True

    def forget(self, up_to_step: int) -> None:
        """Drops the runs, targets and outcomes of steps up to `up_to_step`; a run still going ends."""
        self._targets.discard_where(lambda key: key[0] <= up_to_step)
        for step in [step for step in self._runs if step <= up_to_step]:
            run = self._runs.pop(step)
            run.abort()
            if run.task is not None:
                run.task.cancel()
