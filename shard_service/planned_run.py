"""One planned step (model.train_step) on one stage: its forwards and backwards over the micro-batches, in the order
the schedule gives this stage, on the same Links and with the same items as the PyTorch-shaped loop.

The micro-batches' forward items (activations) and backward items (gradients) come over the stage's links
and wait in the run's inbox until their action's turn; results leave as soon as they exist, so stage i works on
micro-batch k+1 while stage i+1 works on k. Each action's forward or backward is the stage executor's, the one
the loop's items run too (executor.py). The last stage computes each micro-batch's loss against the target the
SDK sent it and starts that micro-batch's backward itself. The run's end is the step's backward on this stage:
the optimizer step item that follows (optimizer_steps.py) is applied once it is over, on every stage or on none.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from shard_service.executor import StageExecutor
from shard_service.held import tensor_bytes
from shard_service.mailbox import Mailbox
from shardtrain import errors, schedule
from shardtrain.v1 import shard_pb2

MAX_RUNS = 4  # planned steps a stage holds at once: the SDK runs one at a time; a few more while one settles


class Figures:
    """What the stage did in one planned step, for StageStats."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.forward_seconds = self.backward_seconds = self.allreduce_seconds = 0.0
        self.peak_activation_bytes = self.peak_in_flight = 0
        self.allreduce_backend = ""
        self.spans: list[shard_pb2.WorkSpan] = []

    def span(self, kind: int, start: float, microbatch: int = 0) -> None:
        """Records a span of work from `start` (time.time()) to now."""
        self.spans.append(shard_pb2.WorkSpan(kind=kind, microbatch=microbatch, start=start, end=time.time()))

    def stats(self, stage: int, replica: int, optimizer_seconds: float) -> shard_pb2.StageStats:
        self.span(shard_pb2.WORK_KIND_OPTIMIZER, time.time() - optimizer_seconds)  # it ended just now
        return shard_pb2.StageStats(
            stage=stage, replica=replica, forward_seconds=self.forward_seconds,
            backward_seconds=self.backward_seconds, allreduce_wait_seconds=self.allreduce_seconds,
            optimizer_seconds=optimizer_seconds, step_seconds=time.perf_counter() - self.started,
            peak_activation_bytes=self.peak_activation_bytes, peak_in_flight=self.peak_in_flight,
            allreduce_backend=self.allreduce_backend, spans=self.spans)


class PlannedRun:
    """The actions of one stage in one planned step, run by the stage's executor (executor.py); the last stage's
    loss targets wait in `targets`, by (step, micro-batch)."""

    def __init__(self, executor: StageExecutor, step: int, plan: shard_pb2.StepPlan, targets: Mailbox | None = None):
        self.executor, self.runtime = executor, executor.runtime
        self.step = step
        self.plan = plan
        where = self.runtime.plan
        self.index, self.num_stages = where.stage, where.num_stages
        self.is_last = self.index == self.num_stages - 1
        self.virtual_stages = max(where.virtual_stages, 1)
        self.actions = _actions(plan, self.index, self.num_stages, self.virtual_stages)
        self.split = plan.schedule in schedule.SPLIT_BACKWARD  # backward as B (input gradient), then W
        # Several stages on this device: their actions take turns in the device's order.
        self.turns = plan.schedule in schedule.INTERLEAVED and self.runtime.device is not None
        self.final_backward = self.actions[-1].microbatch if self.actions else -1
        self.figures = Figures()
        # The micro-batches' items until their action's turn; their bytes count against the shard's budget.
        self._inbox = Mailbox(held=executor.held)
        self._targets = targets if targets is not None else Mailbox()
        self.task: asyncio.Task | None = None  # what runs execute(), once started
        self.began = 0.0  # when the last piece of work started (time.time()), for its span
        self.done = False     # every action ran
        self.aborted = False  # the step failed, here or on another stage

    # --- what arrives ------------------------------------------------------------------------------
    def deliver(self, microbatch: int, kind: str, value) -> None:
        """A micro-batch's forward (header, activation) or backward (header, gradient) item, for its turn.
        ResourceExhausted if its tensor does not fit what the shard may hold waiting."""
        if not 0 <= microbatch < self.plan.microbatches:
            raise errors.InvalidArgument(f"step {self.step} is planned over {self.plan.microbatches} micro-batches; "
                                         f"got a {kind} item for micro-batch {microbatch}")
        if self._inbox.has((microbatch, kind)):
            raise errors.InvalidArgument(f"a second {kind} item for step {self.step} micro-batch {microbatch}")
        self._inbox.put((microbatch, kind), value, tensor_bytes(value[1]))

    async def _take(self, microbatch: int, kind: str):
        what = f"the {kind} of step {self.step} micro-batch {microbatch}"
        return await self._inbox.take((microbatch, kind), self.executor.timeout, what)

    def held_bytes(self) -> int:
        """Bytes of the items that wait in the inbox."""
        return self._inbox.held_bytes()

    # --- running -----------------------------------------------------------------------------------
    async def execute(self) -> None:
        """Runs every action in order, then the replicas' all-reduce; raises what failed."""
        self.figures.allreduce_backend = await self.runtime.averager_call("connect") or ""
        for action in self.actions:
            if action.op == schedule.FORWARD:
                await self._forward(action.microbatch)
            elif action.op == schedule.BACKWARD:
                await self._backward(action.microbatch)
            else:
                await self._weight(action.microbatch)
            in_flight = len(self.executor.stage.in_flight_steps)
            self.figures.peak_in_flight = max(self.figures.peak_in_flight, in_flight)
        start, wall = time.perf_counter(), time.time()
        await self.runtime.averager_call("finish")
        self.figures.allreduce_seconds = time.perf_counter() - start
        if self.figures.allreduce_backend:
            self.figures.span(shard_pb2.WORK_KIND_ALLREDUCE, wall)

    def _compute(self, op: str, k: int, simulated: float = 1.0, turn: bool = True) -> Callable[..., Awaitable[tuple]]:
        """How action (op, k) runs its stage work: in its turn on a shared device (unless `turn` is False: work
        within an action's turn, as the last stage's loss); with simulated compute (benchmarks), then waits
        `simulated` times its device time. `began` says when it started (time.time())."""
        turns = self.turns and turn

        async def compute(function, *args) -> tuple:
            device = self.runtime.device
            if turns:
                await device.turn(self.step, self._device_order, (self.index, op, k), self.executor.timeout)
            try:
                start, self.began = time.perf_counter(), time.time()
                result = await self.runtime.run(function, *args)
                simulate = self.runtime.settings.simulate_compute
                if simulated and simulate:
                    await asyncio.sleep(simulate * simulated)
                return result, time.perf_counter() - start
            finally:
                if turns:
                    device.turn_done(self.step)
        return compute

    def _device_order(self) -> list[tuple[int, str, int]]:
        """Every action of this step on this stage's device, its other stages' included, in the device's order."""
        devices = self.num_stages // self.virtual_stages
        return [(stage, action.op, action.microbatch) for stage, action in schedule.device_actions(
            self.plan.schedule, self.index % devices, self.num_stages, self.plan.microbatches, self.virtual_stages)]

    async def _forward(self, k: int) -> None:
        executor, sends = self.executor, self.executor.sends
        header, x = await self._take(k, schedule.FORWARD)
        output, outgoing, seconds = await executor.forward(header, x, microbatches=self.plan.microbatches,
                                                           compute=self._compute(schedule.FORWARD, k))
        wall = self.began
        self.figures.forward_seconds += seconds
        self.figures.peak_activation_bytes = max(self.figures.peak_activation_bytes, executor.stage.in_flight_bytes)
        if self.is_last:
            loss = await self._loss(header.key, k)
            self.figures.span(shard_pb2.WORK_KIND_FORWARD, wall, k)
            await sends.loss(header.key, loss)
        else:
            self.figures.span(shard_pb2.WORK_KIND_FORWARD, wall, k)
            await sends.activation(header, output)
        await sends.residuals(header.key, outgoing, to_client=False)
        await executor.no_client_gradients(header.key)

    async def _loss(self, key: shard_pb2.StepKey, k: int) -> float:
        """The last stage's loss of micro-batch k against the target the SDK sent, within the forward's time."""
        what = f"the target of step {key.step} micro-batch {key.microbatch}"
        target, y = await self._targets.take((key.step, key.microbatch), self.executor.timeout, what)
        loss_fn, sums = self.runtime.loss(target.loss) if not target.loss.model_output else (None, False)
        loss, seconds = await self._compute(schedule.FORWARD, k, simulated=0, turn=False)(
            self.executor.stage.attach_loss, (self.step, k), loss_fn, y, _weight(target, sums),
            target.loss.model_output, target.loss_scale or 1.0)
        self.figures.forward_seconds += seconds
        return loss

    async def _backward(self, k: int) -> None:
        key = shard_pb2.StepKey(deployment_id=self.runtime.deployment_id, step=self.step, microbatch=k)
        # The last stage starts from its loss (Stage.backward seeds it with ones); the others from the next stage.
        grad = None if self.is_last else (await self._take(k, schedule.BACKWARD))[1]
        if not self.split:
            self.runtime.averager_arm(k == self.final_backward)
        compute = self._compute(schedule.BACKWARD, k, simulated=0.5 if self.split else 1.0)
        grad_input, incoming_grads, seconds = await self.executor.backward((self.step, k), grad,
                                                                           input_half=self.split, compute=compute)
        self.figures.backward_seconds += seconds
        self.figures.span(shard_pb2.WORK_KIND_BACKWARD, self.began, k)
        # None when the loss does not depend on this stage's input (the stage before skips it).
        await self.executor.sends.input_gradient(key, grad_input, planned=True)
        await self.executor.sends.residual_gradients(key, incoming_grads)

    async def _weight(self, k: int) -> None:
        """The weight-gradient half of a split backward: nothing waits for it, so it fills the stage's idle time."""
        self.runtime.averager_arm(k == self.final_backward)
        _, seconds = await self._compute(schedule.WEIGHT, k, simulated=0.5)(self.executor.stage.backward_weight,
                                                                            (self.step, k))
        self.figures.backward_seconds += seconds
        self.figures.span(shard_pb2.WORK_KIND_WEIGHT, self.began, k)

    def abort(self) -> None:
        """Drops what waits in the inbox and fails every wait for an item that will not come now."""
        self.aborted = True
        if self.turns:
            self.runtime.device.give_up(self.step)
        self._inbox.discard_where(lambda key: True, errors.Cancelled(f"step {self.step} failed on another stage"))


def check_plan(plan: shard_pb2.StepPlan) -> None:
    """InvalidArgument unless `plan` names a known schedule and a micro-batch count within bounds."""
    if plan.schedule not in schedule.SCHEDULES:
        raise errors.InvalidArgument(f"unknown schedule {plan.schedule!r}; expected one of {schedule.SCHEDULES}")
    if not 1 <= plan.microbatches <= schedule.MAX_MICROBATCHES:
        raise errors.InvalidArgument(f"a planned step has 1 to {schedule.MAX_MICROBATCHES} micro-batches, "
                                     f"got {plan.microbatches}")


def _actions(plan: shard_pb2.StepPlan, stage: int, num_stages: int, virtual_stages: int) -> list[schedule.Action]:
    check_plan(plan)
    per_device = virtual_stages if plan.schedule in schedule.INTERLEAVED else 1  # others order stages one by one
    return schedule.stage_actions(plan.schedule, stage, num_stages, plan.microbatches, per_device)


def _weight(target: shard_pb2.LossTarget, sums: bool) -> float:
    """A micro-batch's share of the batch's loss: its rows over the whole batch's for a mean-reducing loss, so that
    the micro-batches' gradients add up to the whole batch's."""
    if not 0 < target.rows <= target.batch_rows:
        raise errors.InvalidArgument(f"a target's rows must be within 1..batch_rows, got {target.rows} of "
                                     f"{target.batch_rows}")
    if not (math.isfinite(target.loss_scale) and target.loss_scale >= 0):
        raise errors.InvalidArgument(f"a target's loss_scale must be a finite number >= 0, got {target.loss_scale}")
    return 1.0 if sums else target.rows / target.batch_rows
