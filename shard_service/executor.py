"""One stage's forwards and backwards, whichever mode asked for them: the PyTorch-shaped loop's items (a schedule of
one micro-batch whose actions arrive as the script calls, performed as the deployment's runtime lists them:
runtime.py) and a planned step's actions (planned_run.py) run the same code here. A forward waits for the
residuals it reads and the optimizer step it follows, a backward for the gradients of the residuals its stage
produced; both run on the compute thread, and their results leave through the stage's sends (sends.py)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import torch

from shard_service import step_machine as machine
from shard_service.held import HeldItems
from shard_service.mailbox import Mailbox
from shardtrain import errors
from shardtrain.residuals import CLIENT
from shardtrain.v1 import shard_pb2

if TYPE_CHECKING:  # the sends are I/O: the executor only calls them, and loads no gRPC itself
    from shard_service.sends import StageSends

def _check_forward(header: shard_pb2.ForwardHeader, x: torch.Tensor | None) -> None:
    if x is None:
        raise errors.InvalidArgument("a forward item carries the activation tensor")
    if header.HasField("step_first"):
        raise errors.InvalidArgument("on a Link an optimizer step travels as a step item, not in step_first")


Compute = Callable[..., Awaitable[tuple]]  # (function, *args) -> (its result, seconds it ran)


class StageExecutor:
    """Runs the actions of one stage for one deployment over its shard (shard.py); recreated per deployment."""

    def __init__(self, shard, stage, sends: StageSends, held: HeldItems | None = None):
        self.shard, self.stage, self.sends = shard, stage, sends
        self.held = held if held is not None else HeldItems()  # what waits to run here, under one bound
        self.residuals = Mailbox()  # residuals pushed here by their producers, by (step, microbatch, name)
        self.timeout = shard.settings.timeouts.peer_wait
        self.deployment = shard.deployment  # the deployment's order and planned steps (runtime.py)

    @property
    def forwarded(self) -> int:
        """The highest step this stage started a forward for (steps count from 0)."""
        return self.deployment.forwarded

    async def timed(self, function, *args) -> tuple:
        """Runs stage work on the compute thread; its result and how long it took."""
        start = time.perf_counter()
        result = await self.shard.run(function, *args)
        return result, time.perf_counter() - start

    async def forward(self, header: shard_pb2.ForwardHeader, x: torch.Tensor, after: int = 0,
                      microbatches: int = 0, compute: Compute | None = None) -> tuple:
        """Runs the forward of the header's (step, micro-batch) once its residuals are in and the optimizer step it
        follows (or `after`, if later) settled here. `microbatches`: of a planned step, which always trains (0: a
        loop forward, whose header says what takes gradients). Returns (output, outgoing residuals, seconds)."""
        incoming = await self.incoming_residuals(header.key)
        await self.shard.order.after_optimizer_step(max(header.after_optimizer_step, after), self.timeout)
        if header.zero_grad:
            await self.shard.run(self.stage.weights.zero_grad)
        key, training = (header.key.step, header.key.microbatch), not header.eval_mode
        grads = (True, False) if microbatches else (header.requires_grad, header.input_requires_grad)
        (output, outgoing), seconds = await (compute or self.timed)(
            self.stage.forward, key, x, incoming, *grads, training, *((microbatches,) if microbatches else ()))
        if grads[0] and training:
            self.shard.steps.forward(x, seconds)
        return output, outgoing, seconds

    async def backward(self, key: tuple[int, int], grad: torch.Tensor | None, zero_grad: bool = False,
                       input_half: bool = False, compute: Compute | None = None) -> tuple:
        """Runs the backward of (step, micro-batch) (with `input_half`, only its input gradient: zero-bubble's B)
        once the gradients of the residuals this stage produced are in. Returns (input gradient, the gradients of
        the residuals it read, seconds)."""
        if zero_grad:
            await self.shard.run(self.stage.weights.zero_grad)
        residual_grads = await self.shard.residual_gradients(self.stage, key)
        work = self.stage.backward_input if input_half else self.stage.backward
        (grad_input, incoming_grads), seconds = await (compute or self.timed)(work, key, grad, residual_grads)
        return grad_input, incoming_grads, seconds

    async def loop_forward(self, header: shard_pb2.ForwardHeader, x: torch.Tensor | None,
                           after_verdict: int = 0) -> BaseException | None:
        """A forward of the loop (a schedule of one micro-batch, its action come as the script called): runs once
        the optimizer step the SDK names has settled here, and every step whose verdict came before it (the SDK
        stops naming one after a failure, when a verdict sent again over a new link may still come first), then
        sends what the runtime says it sends, in its order. Returns the failure it reported, if any."""
        key, by_call = header.key, self.sends.links.by_call
        if header.keep_output:
            by_call.add(key.step)
        else:
            by_call.discard(key.step)  # the SDK's own step of that number
        try:
            self.shard.stage_for(key.deployment_id)
            _check_forward(header, x)
            for effect in self.deployment.loop_forward(key.microbatch, last=not self.shard.plan.next_address):
                if isinstance(effect, machine.Compute):
                    output, outgoing, _ = await self.forward(header, x, after=after_verdict)
                    self.deployment.forward_started(key.step)
                elif effect.what == machine.RESIDUALS:
                    await self.sends.residuals(key, outgoing)
                else:  # the activation on, or from the last stage the output to the SDK
                    await self.sends.activation(header, output)
        except Exception as error:  # noqa: BLE001 - reported to the SDK, which waits for this step
            await self.sends.report(key, error, backward=False)
            return error
        return None

    async def loop_backward(self, header: shard_pb2.BackwardHeader, grad: torch.Tensor | None) -> BaseException | None:
        """A backward of the loop: the stage's backward, then the gradients the runtime says it sends, in its order;
        its outcome settles the step's backward here. Returns the failure it reported, if any."""
        key = header.key
        try:
            self.shard.stage_for(key.deployment_id)
            for effect in self.deployment.loop_backward(key.microbatch):
                if isinstance(effect, machine.Compute):
                    grad_input, incoming_grads, _ = await self.backward((key.step, key.microbatch), grad,
                                                                        zero_grad=header.zero_grad)
                elif effect.what == machine.INPUT_GRADIENT:
                    await self.sends.input_gradient(key, grad_input, zero_grad=header.zero_grad)
                else:
                    await self.sends.residual_gradients(key, incoming_grads)
        except Exception as error:  # noqa: BLE001 - reported to the SDK; no stage will step on it
            await self.sends.report(key, error, backward=True)
            reason = errors.located_message(error, self.shard.location)
            await self.shard.order.backward_finished(key.step, reason)
            return error
        await self.shard.order.backward_finished(key.step, "")
        return None

    async def incoming_residuals(self, key: shard_pb2.StepKey) -> dict[str, torch.Tensor]:
        """The residuals this stage reads in (step, micro-batch), as their producers pushed them, checked."""
        incoming = {}
        for name in self.stage.residuals.incoming:
            producer = self.shard.producer(name).producer_stage
            source = "the SDK" if producer == CLIENT else f"stage {producer}"
            what = f"residual {name!r} of step {key.step} micro-batch {key.microbatch} from {source}"
            tensor = await self.residuals.take((key.step, key.microbatch, name), self.timeout, what)
            spec = self.stage.incoming_spec(name)
            if spec is not None:
                spec.check(tensor, f"residual {name!r} from {source}")
            if key.step in self.sends.links.by_call:  # a client of the per-call RPCs may fetch it (FetchTensor)
                self.sends.links.calls.keep(key, name, tensor)
            incoming[name] = tensor
        return incoming

    async def no_client_gradients(self, key: shard_pb2.StepKey) -> None:
        """In a planned step the SDK sends no gradient for the model's outputs (the loss is taken on the last
        stage): each output's share from the SDK counts as none."""
        for name, consumers in self.stage.residuals.outgoing.items():
            if CLIENT in consumers:
                await self.shard.accumulate(key, name, None)

    def forget(self, up_to_step: int) -> None:
        """Drops the residuals of steps up to `up_to_step` that no forward took."""
        self.residuals.discard_where(lambda key: key[0] <= up_to_step)
