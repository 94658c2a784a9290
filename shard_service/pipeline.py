"""One TrainStep on one stage: the planned forward and backward actions over the micro-batches, in order.

Activations and gradients arrive from the neighbouring shards into an inbox (scheduled Forward and
Backward calls) and leave for them as soon as they exist; this stage never waits on anything but
its own inputs, so stage i works on micro-batch k+1 while stage i+1 works on k. The last stage
computes the loss; backward starts there.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from shard_service.stage import Stage
from shardtrain.errors import InvalidArgument
from shardtrain.v1 import shard_pb2


@dataclass
class Figures:
    """What the stage did in this step, for StageStats."""

    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    peak_activation_bytes: int = 0
    peak_in_flight: int = 0
    losses: list[float] = field(default_factory=list)


class PipelineRun:
    """Runs a stage's actions of one TrainStep through the servicer that owns the stage (`shard`)."""

    def __init__(self, shard, stage: Stage, header: shard_pb2.TrainStepHeader, tensors: dict[str, torch.Tensor],
                 loss=None):
        self.shard, self.stage, self.header = shard, stage, header
        self.plan = shard.links.plan
        self.first = self.plan.stage == 0
        self.last = self.plan.stage == self.plan.num_stages - 1
        self.microbatches = len(header.microbatch_sizes)
        # Gradients are final, and all-reduce as they appear, in the backward of this micro-batch.
        self.final_backward = [a.microbatch for a in header.actions if a.backward][-1] if header.actions else -1
        self.loss_fn, self.loss_sums = loss if loss is not None else (None, False)
        self.tensors = tensors
        self.figures = Figures()
        self._sends: list[asyncio.Task] = []
        self._check()
        # One call per neighbour and direction for the whole step: a message on an open stream costs
        # far less than a call per micro-batch.
        self._activations = None if self.last else _Outgoing(shard, "activation", self._key(0))
        self._gradients = None if self.first else _Outgoing(shard, "gradient", self._key(0))

    def _check(self) -> None:
        actions = [(a.backward, a.microbatch) for a in self.header.actions]
        expected = {(backward, k) for backward in (False, True) for k in range(self.microbatches)}
        if sorted(actions) != sorted(expected):
            raise InvalidArgument(f"stage {self.plan.stage}: the plan must run forward and backward of each of "
                                  f"{self.microbatches} micro-batches once, got {len(actions)} actions")
        needed = [f"input/{k}" for k in range(self.microbatches)] if self.first else []
        needed += [f"target/{k}" for k in range(self.microbatches)] if self.last else []
        missing = sorted(set(needed) - set(self.tensors))
        if missing:
            raise InvalidArgument(f"stage {self.plan.stage}: TrainStep lacks tensors {missing[:4]}")
        if self.last and self.loss_fn is None:
            raise InvalidArgument(f"stage {self.plan.stage} is the last stage: a TrainStep needs a loss")

    def _key(self, microbatch: int) -> shard_pb2.StepKey:
        return shard_pb2.StepKey(deployment_id=self.header.key.deployment_id, step=self.header.key.step,
                                 microbatch=microbatch)

    async def execute(self) -> Figures:
        """Runs every action in plan order, then waits for the tensors it sent to be taken."""
        try:
            for action in self.header.actions:
                if action.backward:
                    await self._backward(action.microbatch)
                else:
                    await self._forward(action.microbatch)
                self.figures.peak_in_flight = max(self.figures.peak_in_flight, len(self.stage.in_flight_steps))
            streams = [s.close() for s in (self._activations, self._gradients) if s is not None]
            await asyncio.gather(*self._sends, *streams)
        finally:
            for task in self._sends:
                task.cancel()
            for stream in (self._activations, self._gradients):
                if stream is not None:
                    stream.abandon()
        return self.figures

    async def _timed(self, function, *args, simulated: bool = True):
        start = time.perf_counter()
        result = await self.shard.run(function, *args)
        if simulated and self.shard.settings.simulate_compute:  # stands for device work (benchmarks)
            await asyncio.sleep(self.shard.settings.simulate_compute)
        return result, time.perf_counter() - start

    async def _forward(self, k: int) -> None:
        key = (self.header.key.step, k)
        x = self.tensors[f"input/{k}"] if self.first else await self.shard.scheduled_input(self._key(k), "activation")
        incoming = await self.shard.fetch_residuals(self.stage, self._key(k))
        (output, outgoing), seconds = await self._timed(self.stage.forward, key, x, incoming, True, False,
                                                        not self.header.eval_mode)
        self.figures.forward_seconds += seconds
        self.figures.peak_activation_bytes = max(self.figures.peak_activation_bytes, self.stage.in_flight_bytes)
        self.shard.offer_residuals(self.stage, key, outgoing)
        if self.last:
            weight = self._weight(k)
            loss, seconds = await self._timed(self.stage.attach_loss, key, self.loss_fn, self.tensors[f"target/{k}"],
                                              weight, simulated=False)  # part of the forward's simulated time
            self.figures.forward_seconds += seconds
            self.figures.losses.append(loss)
        else:
            self._activations.send(k, output)

    def _weight(self, k: int) -> float:
        """A micro-batch's share of the batch's loss: its rows over the whole batch's, for averaging losses."""
        return 1.0 if self.loss_sums else self.header.microbatch_sizes[k] / self.header.batch_size

    async def _backward(self, k: int) -> None:
        key = (self.header.key.step, k)
        # The last stage starts from its loss (Stage.backward seeds it with ones); the others from their inbox.
        grad = None if self.last else await self.shard.scheduled_input(self._key(k), "gradient")
        residual_grads = await self.shard.residual_gradients(self.stage, key)
        self.shard.averager_arm(k == self.final_backward)
        (grad_input, incoming_grads), seconds = await self._timed(self.stage.backward, key, grad, residual_grads)
        self.figures.backward_seconds += seconds
        for name, residual_grad in incoming_grads.items():
            push = self.shard.links.send_residual_grad(self._key(k), name, residual_grad)
            self._sends.append(asyncio.ensure_future(push))
        if not self.first:
            if grad_input is None:
                raise InvalidArgument(f"stage {self.plan.stage}: micro-batch {k} produced no input gradient")
            self._gradients.send(k, grad_input)


class _Outgoing:
    """A step's stream of activations (or input gradients) to one neighbour, fed as micro-batches finish."""

    def __init__(self, shard, kind: str, key: shard_pb2.StepKey):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._call = asyncio.ensure_future(shard.links.send_scheduled(key, kind, self._tensors()))

    async def _tensors(self):
        while (item := await self._queue.get()) is not None:
            yield item

    def send(self, microbatch: int, tensor: torch.Tensor) -> None:
        """Queues one micro-batch's tensor; the call sends it as soon as the stream can take it."""
        self._queue.put_nowait((microbatch, tensor))

    async def close(self) -> None:
        """Ends the stream and waits for the neighbour's answer."""
        self._queue.put_nowait(None)
        await self._call

    def abandon(self) -> None:
        """Cancels the call (a no-op once it finished)."""
        self._call.cancel()
