"""One planned step (model.train_step) on one stage: its forwards and backwards over the micro-batches, in the order
the schedule gives this stage, on the same Links and with the same items as the PyTorch-shaped loop.

The micro-batches' forward items (activations) and backward items (gradients) come over the stage's links
and wait in the run's inbox until their action's turn; results leave as soon as they exist, so stage i works on
micro-batch k+1 while stage i+1 works on k. The last stage computes each micro-batch's loss against the target
the SDK sent it and starts that micro-batch's backward itself. The run's end is the step's backward on this stage:
the optimizer step item that follows (loop.py) is applied once it is over, on every stage or on none.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

import torch

from shard_service.held import HeldItems, tensor_bytes
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
    """The actions of one stage in one planned step. `ports` is what the run needs of its shard (StagePorts)."""

    def __init__(self, ports: StagePorts, step: int, plan: shard_pb2.StepPlan):
        self.ports = ports
        self.step = step
        self.plan = plan
        self.actions = _actions(plan, ports.index, ports.num_stages, ports.virtual_stages)
        self.split = plan.schedule in schedule.SPLIT_BACKWARD  # backward as B (input gradient), then W
        # Several stages on this device: their actions take turns in the device's order.
        self.turns = plan.schedule in schedule.INTERLEAVED and ports.device is not None
        self.final_backward = self.actions[-1].microbatch if self.actions else -1
        self.figures = Figures()
        # The micro-batches' items until their action's turn; their bytes count against the shard's budget.
        self._inbox = Mailbox(held=ports.held)
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
        return await self._inbox.take((microbatch, kind), self.ports.timeout, what)

    def held_bytes(self) -> int:
        """Bytes of the items that wait in the inbox."""
        return self._inbox.held_bytes()

    # --- running -----------------------------------------------------------------------------------
    async def execute(self) -> None:
        """Runs every action in order, then the replicas' all-reduce; raises what failed."""
        ports = self.ports
        self.figures.allreduce_backend = await ports.averager("connect") or ""
        for action in self.actions:
            if action.op == schedule.FORWARD:
                await self._forward(action.microbatch)
            elif action.op == schedule.BACKWARD:
                await self._backward(action.microbatch)
            else:
                await self._weight(action.microbatch)
            self.figures.peak_in_flight = max(self.figures.peak_in_flight, ports.in_flight())
        start, wall = time.perf_counter(), time.time()
        await ports.averager("finish")
        self.figures.allreduce_seconds = time.perf_counter() - start
        if self.figures.allreduce_backend:
            self.figures.span(shard_pb2.WORK_KIND_ALLREDUCE, wall)

    async def _timed(self, function, *args, simulated: float = 1.0, action: tuple[str, int] | None = None):
        """Runs stage work (action `action`'s, in its turn on a shared device); with simulated compute (benchmarks),
        then waits `simulated` times its device time. `began` says when it started (time.time())."""
        if self.turns and action is not None:
            await self.ports.device.turn(self.step, self._device_order, (self.ports.index, *action), self.ports.timeout)
        try:
            start, self.began = time.perf_counter(), time.time()
            result = await self.ports.run(function, *args)
            if simulated and self.ports.simulate_compute:
                await asyncio.sleep(self.ports.simulate_compute * simulated)
            return result, time.perf_counter() - start
        finally:
            if self.turns and action is not None:
                self.ports.device.turn_done(self.step)

    def _device_order(self) -> list[tuple[int, str, int]]:
        """Every action of this step on this stage's device, its other stages' included, in the device's order."""
        ports = self.ports
        devices = ports.num_stages // ports.virtual_stages
        return [(stage, action.op, action.microbatch) for stage, action in schedule.device_actions(
            self.plan.schedule, ports.index % devices, ports.num_stages, self.plan.microbatches, ports.virtual_stages)]

    async def _forward(self, k: int) -> None:
        ports = self.ports
        header, x = await self._take(k, schedule.FORWARD)
        incoming = await ports.incoming_residuals(header.key)
        await ports.after_optimizer_step(header.after_optimizer_step)
        if header.zero_grad:
            await ports.run(ports.stage.zero_grad)
        (output, outgoing), seconds = await self._timed(ports.stage.forward, (self.step, k), x, incoming, True,
                                                        False, not header.eval_mode, self.plan.microbatches,
                                                        action=(schedule.FORWARD, k))
        wall = self.began
        ports.forwarded(x, seconds)
        self.figures.forward_seconds += seconds
        self.figures.peak_activation_bytes = max(self.figures.peak_activation_bytes, ports.stage.in_flight_bytes)
        if ports.is_last:
            target, y = await ports.target(header.key)
            loss_fn, sums = ports.loss(target.loss) if not target.loss.model_output else (None, False)
            loss, seconds = await self._timed(ports.stage.attach_loss, (self.step, k), loss_fn, y,
                                              _weight(target, sums), target.loss.model_output,
                                              target.loss_scale or 1.0, simulated=0)  # within the simulated time
            self.figures.forward_seconds += seconds
            self.figures.span(shard_pb2.WORK_KIND_FORWARD, wall, k)
            await ports.send_loss(header.key, loss)
        else:
            self.figures.span(shard_pb2.WORK_KIND_FORWARD, wall, k)
            await ports.send_activation(header, output)
        await ports.send_residuals(header.key, outgoing)
        await ports.no_client_gradients(header.key)

    async def _backward(self, k: int) -> None:
        ports = self.ports
        key = shard_pb2.StepKey(deployment_id=ports.deployment_id, step=self.step, microbatch=k)
        # The last stage starts from its loss (Stage.backward seeds it with ones); the others from the next stage.
        grad = None if ports.is_last else (await self._take(k, schedule.BACKWARD))[1]
        residual_grads = await ports.residual_gradients((self.step, k))
        if not self.split:
            ports.averager_arm(k == self.final_backward)
        work = ports.stage.backward_input if self.split else ports.stage.backward
        (grad_input, incoming_grads), seconds = await self._timed(work, (self.step, k), grad, residual_grads,
                                                                  simulated=0.5 if self.split else 1.0,
                                                                  action=(schedule.BACKWARD, k))
        self.figures.backward_seconds += seconds
        self.figures.span(shard_pb2.WORK_KIND_BACKWARD, self.began, k)
        if ports.index > 0:  # None when the loss does not depend on this stage's input (the stage before skips it)
            await ports.send_input_gradient(key, grad_input)
        await ports.send_residual_gradients(key, incoming_grads)

    async def _weight(self, k: int) -> None:
        """The weight-gradient half of a split backward: nothing waits for it, so it fills the stage's idle time."""
        self.ports.averager_arm(k == self.final_backward)
        _, seconds = await self._timed(self.ports.stage.backward_weight, (self.step, k), simulated=0.5,
                                       action=(schedule.WEIGHT, k))
        self.figures.backward_seconds += seconds
        self.figures.span(shard_pb2.WORK_KIND_WEIGHT, self.began, k)

    def abort(self) -> None:
        """Drops what waits in the inbox and fails every wait for an item that will not come now."""
        self.aborted = True
        if self.turns:
            self.ports.device.give_up(self.step)
        self._inbox.discard_where(lambda key: True, errors.Cancelled(f"step {self.step} failed on another stage"))


class StagePorts:
    """What a planned run uses of its shard: the stage and its compute thread, the links' sends, the waits.
    A plain record of callables, so that the run can be driven without a server."""

    def __init__(self, *, stage, index: int, num_stages: int, deployment_id: str, timeout: float,
                 simulate_compute: float, run: Callable[..., Awaitable], in_flight: Callable[[], int],
                 averager: Callable[[str], Awaitable], averager_arm: Callable[[bool], None],
                 incoming_residuals, after_optimizer_step, target, loss, send_loss, send_activation,
                 send_residuals, no_client_gradients, residual_gradients, send_input_gradient,
                 send_residual_gradients, device=None, virtual_stages: int = 1,
                 forwarded: Callable[[torch.Tensor | None, float], None] = lambda x, seconds: None,
                 held: HeldItems | None = None):
        self.stage, self.index, self.num_stages = stage, index, num_stages
        self.is_last = index == num_stages - 1
        self.deployment_id, self.timeout, self.simulate_compute = deployment_id, timeout, simulate_compute
        self.run, self.in_flight, self.averager, self.averager_arm = run, in_flight, averager, averager_arm
        self.incoming_residuals, self.after_optimizer_step = incoming_residuals, after_optimizer_step
        self.target, self.loss, self.send_loss = target, loss, send_loss
        self.send_activation, self.send_residuals = send_activation, send_residuals
        self.no_client_gradients = no_client_gradients
        self.residual_gradients = residual_gradients
        self.send_input_gradient, self.send_residual_gradients = send_input_gradient, send_residual_gradients
        self.device, self.virtual_stages = device, virtual_stages  # shard_service.device.Device, stages on it
        self.forwarded = forwarded  # a training forward ran on this input (for metrics: step time, samples)
        self.held = held  # what the shard's stage may hold waiting, shared with its other items


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
