"""One planned step (model.train_step) on one stage: its forwards and backwards over the micro-batches, in the order
the schedule gives this stage, on the same Links and with the same items as the PyTorch-shaped loop.

The step's machine (step_machine.py) decides what runs next and what is sent after it; the run here is its adapter:
it feeds it the items that arrive, the computations that finish and the deadlines that pass, and performs the
effects it returns. The micro-batches' forward items (activations) and backward items (gradients) wait in the
run's inbox until their action's turn; results leave as soon as they exist, so stage i works on micro-batch k+1
while stage i+1 works on k. Each action's forward or backward is the stage executor's, the one the loop's items run
too (executor.py). The last stage computes each micro-batch's loss against the target the SDK sent it and starts
that micro-batch's backward itself. The run's end is the step's backward on this stage: the optimizer step item
that follows (optimizer_steps.py) is applied once it is over, on every stage or on none."""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import time
from collections.abc import Awaitable, Callable

from shard_service import step_machine as machine
from shard_service.executor import StageExecutor
from shard_service.held import tensor_bytes
from shard_service.mailbox import Mailbox
from shardtrain import errors, schedule
from shardtrain.v1 import shard_pb2
from shardtrain.waiting import settled_within

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
    """The actions of one stage in one planned step: its machine (step_machine.py) decides what runs and what is
    sent, this run performs it with the stage's executor (executor.py) and sends. The last stage's loss targets wait
    in `targets`, by (step, micro-batch)."""

    def __init__(self, executor: StageExecutor, step: int, plan: shard_pb2.StepPlan, targets: Mailbox | None = None):
        self.executor, self.shard = executor, executor.shard
        self.step = step
        self.plan = plan
        where = self.shard.plan
        self.index, self.num_stages = where.stage, where.num_stages
        self.is_last = self.index == self.num_stages - 1
        self.virtual_stages = max(where.virtual_stages, 1)
        self.split = plan.schedule in schedule.SPLIT_BACKWARD  # backward as B (input gradient), then W
        # Refused here (InvalidArgument, ResourceExhausted) unless the deployment may start the step.
        self.machine = executor.deployment.start_step(step, plan.schedule, plan.microbatches, self.index,
                                                      self.num_stages, self.virtual_stages)
        # Several stages on this device: their actions take turns in the device's order.
        self.turns = plan.schedule in schedule.INTERLEAVED and self.shard.device is not None
        self.figures = Figures()
        # The micro-batches' items until their action's turn; their bytes count against the shard's budget.
        self._inbox = Mailbox(held=executor.held)
        self._targets = targets if targets is not None else Mailbox()
        self._results: dict[tuple[str, int], tuple] = {}  # what a computation made, until it is sent
        self._effects: collections.deque = collections.deque()  # what the machine returned, to perform in order
        self._wake: asyncio.Future | None = None  # set when effects come while execute() waits
        self._deadline = math.inf  # when the item awaited is late (loop time)
        self.task: asyncio.Task | None = None  # what runs execute(), once started
        self.began = 0.0  # when the last piece of work started (time.time()), for its span
        self.done = False     # every action ran
        self.aborted = False  # the step failed, here or on another stage

    # --- what arrives ------------------------------------------------------------------------------
    def deliver(self, microbatch: int, kind: str, value) -> None:
        """A micro-batch's forward (header, activation) or backward (header, gradient) item, for its turn.
        InvalidArgument outside the plan or for a second one; ResourceExhausted if its tensor does not fit what the
        shard may hold waiting."""
        effects = self.machine.arrived(kind, microbatch)
        try:  # one refused here is still late for its turn: its action fails by its deadline, as any late item
            if not self.machine.ended:
                self._inbox.put((microbatch, kind), value, tensor_bytes(value[1]))
        finally:
            self._queue(effects)

    def held_bytes(self) -> int:
        """Bytes of the items that wait in the inbox."""
        return self._inbox.held_bytes()

    def abort(self) -> None:
        """The step failed on another stage: drops what waits in the inbox, and execute() ends with Cancelled."""
        self.aborted = True
        self._queue(self.machine.aborted(f"step {self.step} failed on another stage"))
        self._drop()

    def _queue(self, effects: list) -> None:
        if any(isinstance(effect, machine.DropWaiting) for effect in effects):
            self._effects.clear()  # the step ended here: what the machine said before no longer runs
        self._effects.extend(effects)
        if effects and self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    # --- performing --------------------------------------------------------------------------------
    async def execute(self) -> None:
        """Performs what the machine returns, in order, feeding it what happens, until it is done; raises what
        failed."""
        self._queue(self.machine.started())
        while True:
            if not self._effects:
                await self._wait()
                continue
            effect = self._effects.popleft()
            if isinstance(effect, machine.Done):
                return
            if isinstance(effect, machine.Report):
                raise effect.error
            try:
                self._queue(await self._perform(effect))
            except Exception as error:  # noqa: BLE001 - the machine ends the step and reports it
                self._queue(self.machine.failed(error))

    async def _wait(self) -> None:
        """Until more effects come, or the deadline of the item awaited passes."""
        loop = asyncio.get_running_loop()
        self._wake = loop.create_future()
        if self._deadline == math.inf:  # nothing awaited: only the machine's word (an abort) can come
            await self._wake
        elif not await settled_within(self._wake, max(self._deadline - loop.time(), 0.0)):
            self._deadline = math.inf  # passed once: what comes next is the machine's word
            self._queue(self.machine.deadline_passed(self.executor.timeout))

    async def _perform(self, effect) -> list:
        """Performs one effect; returns what the machine says after it."""
        if isinstance(effect, machine.Await):
            return await self._await(effect.kind, effect.microbatch)
        if isinstance(effect, (machine.Compute, machine.ComputeLoss)):
            return await self._computation(effect)
        if isinstance(effect, machine.Send):
            await self._send(effect.what, effect.microbatch)
        elif isinstance(effect, machine.ArmAllReduce):
            self.shard.averager_arm(effect.last)
        elif isinstance(effect, machine.ConnectAllReduce):
            self.figures.allreduce_backend = await self.shard.averager_call("connect") or ""
        elif isinstance(effect, machine.FinishAllReduce):
            await self._finish_allreduce()
            return self.machine.all_reduced()
        elif isinstance(effect, machine.DropWaiting):
            self._drop()
        return []

    async def _computation(self, effect: machine.Compute | machine.ComputeLoss) -> list:
        """Runs an action's stage work, or the last stage's loss; tells the machine it is done."""
        if isinstance(effect, machine.ComputeLoss):
            await self._loss(effect.microbatch)
            return self.machine.computed(machine.LOSS, effect.microbatch)
        work = {schedule.FORWARD: self._forward, schedule.BACKWARD: self._backward, schedule.WEIGHT: self._weight}
        await work[effect.op](effect.microbatch)
        in_flight = len(self.executor.stage.in_flight_steps)
        self.figures.peak_in_flight = max(self.figures.peak_in_flight, in_flight)
        return self.machine.computed(effect.op, effect.microbatch)

    async def _await(self, kind: str, k: int) -> list:
        """A micro-batch's item comes through deliver(), by the deadline; its loss target from the SDK is taken
        here."""
        if kind != machine.TARGET:
            self._deadline = asyncio.get_running_loop().time() + self.executor.timeout
            return []
        what = f"the target of step {self.step} micro-batch {k}"
        self._results[(machine.TARGET, k)] = await self._targets.take((self.step, k), self.executor.timeout, what)
        return self.machine.arrived(machine.TARGET, k)

    async def _finish_allreduce(self) -> None:
        start, wall = time.perf_counter(), time.time()
        await self.shard.averager_call("finish")
        self.figures.allreduce_seconds = time.perf_counter() - start
        if self.figures.allreduce_backend:
            self.figures.span(shard_pb2.WORK_KIND_ALLREDUCE, wall)

    def _compute(self, op: str, k: int, simulated: float = 1.0, turn: bool = True) -> Callable[..., Awaitable[tuple]]:
        """How action (op, k) runs its stage work: in its turn on a shared device (unless `turn` is False: work
        within an action's turn, as the last stage's loss); with simulated compute (benchmarks), then waits
        `simulated` times its device time: on the compute thread, holding the device, as a thread waiting for its
        kernels would (a timer on the event loop fires up to a millisecond late). `began` says when it started
        (time.time())."""
        turns = self.turns and turn

        async def compute(function, *args) -> tuple:
            device = self.shard.device
            if turns:
                await device.turn(self.step, self._device_order, (self.index, op, k), self.executor.timeout)
            try:
                start, self.began = time.perf_counter(), time.time()
                seconds = self.shard.settings.simulate_compute * simulated
                result = await self.shard.run(_then_device_time(function, seconds) if seconds else function, *args)
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

    def _take(self, k: int, kind: str):
        """The item the machine saw come for action (kind, k): in the inbox, unless it was refused there."""
        what = f"the {kind} of step {self.step} micro-batch {k}"
        return self._inbox.take((k, kind), self.executor.timeout, what)

    async def _forward(self, k: int) -> None:
        header, x = await self._take(k, schedule.FORWARD)
        output, outgoing, seconds = await self.executor.forward(header, x, microbatches=self.plan.microbatches,
                                                                compute=self._compute(schedule.FORWARD, k))
        self._results[(schedule.FORWARD, k)] = (header, output, outgoing, self.began)
        self.figures.forward_seconds += seconds
        self.figures.peak_activation_bytes = max(self.figures.peak_activation_bytes,
                                                 self.executor.stage.in_flight_bytes)

    async def _loss(self, k: int) -> None:
        """The last stage's loss of micro-batch k against the target the SDK sent, within the forward's time."""
        target, y = self._results.pop((machine.TARGET, k))
        loss_fn, sums = self.shard.loss(target.loss) if not target.loss.model_output else (None, False)
        loss, seconds = await self._compute(schedule.FORWARD, k, simulated=0, turn=False)(
            self.executor.stage.attach_loss, (self.step, k), loss_fn, y, _weight(target, sums),
            target.loss.model_output, target.loss_scale or 1.0)
        self.figures.forward_seconds += seconds
        self._results[(machine.LOSS, k)] = loss

    async def _backward(self, k: int) -> None:
        # The last stage starts from its loss (Stage.backward seeds it with ones); the others from the next stage.
        grad = None if self.is_last else (await self._take(k, schedule.BACKWARD))[1]
        compute = self._compute(schedule.BACKWARD, k, simulated=0.5 if self.split else 1.0)
        grad_input, incoming_grads, seconds = await self.executor.backward((self.step, k), grad,
                                                                           input_half=self.split, compute=compute)
        self.figures.backward_seconds += seconds
        self.figures.span(shard_pb2.WORK_KIND_BACKWARD, self.began, k)
        self._results[(schedule.BACKWARD, k)] = (grad_input, incoming_grads)

    async def _weight(self, k: int) -> None:
        """The weight-gradient half of a split backward: nothing waits for it, so it fills the stage's idle time."""
        _, seconds = await self._compute(schedule.WEIGHT, k, simulated=0.5)(self.executor.stage.backward_weight,
                                                                            (self.step, k))
        self.figures.backward_seconds += seconds
        self.figures.span(shard_pb2.WORK_KIND_WEIGHT, self.began, k)

    async def _send(self, what: str, k: int) -> None:
        """Sends what micro-batch k's last computation made; a forward's span ends as its result leaves."""
        sends = self.executor.sends
        if what == machine.INPUT_GRADIENT:  # None when the loss does not depend on this stage's input
            await sends.input_gradient(self._key(k), self._results[(schedule.BACKWARD, k)][0], planned=True)
        elif what == machine.RESIDUAL_GRADIENTS:
            await sends.residual_gradients(self._key(k), self._results.pop((schedule.BACKWARD, k))[1])
        elif what == machine.RESIDUALS:
            header, _, outgoing, _ = self._results.pop((schedule.FORWARD, k))
            await sends.residuals(header.key, outgoing, to_client=False)
            await self.executor.no_client_gradients(header.key)
        else:
            header, output, _, began = self._results[(schedule.FORWARD, k)]
            self.figures.span(shard_pb2.WORK_KIND_FORWARD, began, k)
            if what == machine.LOSS:
                await sends.loss(header.key, self._results.pop((machine.LOSS, k)))
            else:
                await sends.activation(header, output)

    def _key(self, k: int) -> shard_pb2.StepKey:
        return shard_pb2.StepKey(deployment_id=self.shard.deployment_id, step=self.step, microbatch=k)

    def _drop(self) -> None:
        """Drops what waits for a turn that will not come, and fails every wait for an item."""
        if self.turns:
            self.shard.device.give_up(self.step)
        self._results.clear()
        self._inbox.discard_where(lambda key: True, errors.Cancelled(f"step {self.step} failed on another stage"))


def _then_device_time(function: Callable, seconds: float) -> Callable:
    """`function`, then `seconds` of simulated device time (benchmarks) on the thread that ran it."""
    @functools.wraps(function)
    def simulated(*args):
        result = function(*args)
        time.sleep(seconds)
        return result
    return simulated


def _weight(target: shard_pb2.LossTarget, sums: bool) -> float:
    """A micro-batch's share of the batch's loss: its rows over the whole batch's for a mean-reducing loss, so that
    the micro-batches' gradients add up to the whole batch's."""
    if not 0 < target.rows <= target.batch_rows:
        raise errors.InvalidArgument(f"a target's rows must be within 1..batch_rows, got {target.rows} of "
                                     f"{target.batch_rows}")
    if not (math.isfinite(target.loss_scale) and target.loss_scale >= 0):
        raise errors.InvalidArgument(f"a target's loss_scale must be a finite number >= 0, got {target.loss_scale}")
    return 1.0 if sums else target.rows / target.batch_rows
