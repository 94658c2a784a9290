"""The SDK's RPCs for one deployment: into the first stage, out of the last, and to every stage at once."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from shardtrain import shm, wire
from shardtrain.errors import InvalidArgument
from shardtrain.residuals import INPUT_GRADIENT, OUTPUT
from shardtrain.rpc import SHARD_SERVICE, OpenedCall, OpenedCalls, Peer, fetch_tensor
from shardtrain.settings import Security, Timeouts
from shardtrain.v1 import shard_pb2, tensor_pb2


class StageClients:
    """One Peer per stage of a deployment, created on the IoLoop (grpc.aio channels belong to a loop)."""

    def __init__(self, deployment_id: str, addresses: Sequence[str], security: Security, timeouts: Timeouts,
                 encodings: tensor_pb2.WireEncodings | None = None):
        self.deployment_id = deployment_id
        self.stages = [Peer(f"shard at {address} (stage {index})", address, SHARD_SERVICE,
                            security, timeouts.rpc) for index, address in enumerate(addresses)]
        self._timeouts = timeouts
        self._encodings = encodings or tensor_pb2.WireEncodings()
        self._segments: shm.SegmentPool | None = None
        self._backward_calls = OpenedCalls()  # opened when a forward's output arrived

    async def probe(self) -> None:
        """Finds which stages share this host: tensors to and from them go through shared memory."""
        if not shm.available():
            return
        await asyncio.gather(self.stages[0].probe(), self.stages[-1].probe())
        if self.stages[0].same_host or self.stages[-1].same_host:
            self._segments = shm.SegmentPool()

    def _options(self, stage: Peer, kind: str) -> wire.SendOptions:
        segments = self._segments if stage.same_host else None
        return wire.SendOptions(encoding=getattr(self._encodings, kind), segments=segments)

    def key(self, step: int, microbatch: int = 0) -> shard_pb2.StepKey:
        """The wire key of a step of this deployment."""
        return shard_pb2.StepKey(deployment_id=self.deployment_id, step=step, microbatch=microbatch)

    async def train_step(self, stage: int, header: shard_pb2.TrainStepHeader,
                         tensors: dict[str, torch.Tensor]) -> shard_pb2.TrainStepResponse:
        """One stage's TrainStep, with its inputs (first stage) or targets (last stage)."""
        peer = self.stages[stage]
        requests = wire.framed(shard_pb2.TrainStepRequest, header, tensors, self._options(peer, "activations"))
        return await peer.call("TrainStep", requests)

    async def forward(self, step: int, x: torch.Tensor, requires_grad: bool, zero_grad: bool,
                      after_optimizer_step: int, step_first: shard_pb2.StepRequest | None = None,
                      input_requires_grad: bool = False) -> tuple[torch.Tensor, asyncio.Future]:
        """Sends x into the first stage and, at the same time, asks the last stage for the output.

        Returns as soon as the output arrives (which proves every stage ran), with the still-running
        Forward call, whose answer only confirms it.
        """
        key = self.key(step)
        header = shard_pb2.ForwardHeader(key=key, requires_grad=requires_grad, zero_grad=zero_grad,
                                         after_optimizer_step=after_optimizer_step, step_first=step_first,
                                         input_requires_grad=input_requires_grad)
        fetch = asyncio.ensure_future(fetch_tensor(self.stages[-1], key, OUTPUT))
        call = asyncio.ensure_future(self.stages[0].call("Forward", wire.framed(
            shard_pb2.ForwardRequest, header, {"activation": x}, self._options(self.stages[0], "activations"))))
        await asyncio.wait([fetch, call], return_when=asyncio.FIRST_COMPLETED)
        if call.done() and call.exception() is not None:
            fetch.cancel()
            raise call.exception()
        try:
            output = await fetch
        except BaseException:
            call.cancel()
            raise
        if requires_grad:
            self._backward_calls.add(step, OpenedCall(self.stages[-1], "Backward", shard_pb2.BackwardRequest,
                                                      shard_pb2.BackwardHeader(key=key),
                                                      self._timeouts.backward_link))
        return output, call

    async def backward(self, step: int, grad: torch.Tensor | None) -> None:
        """Sends the gradient of the output into the last stage; returns once every stage has run backward."""
        tensors = {"gradient": grad} if grad is not None else {}
        call = self._backward_calls.pop(step)
        options = self._options(self.stages[-1], "gradients")
        if call is not None:
            await call.send(tensors, options)
        else:
            header = shard_pb2.BackwardHeader(key=self.key(step))
            await self.stages[-1].call("Backward", wire.framed(shard_pb2.BackwardRequest, header, tensors, options))

    async def input_gradient(self, step: int) -> torch.Tensor:
        """The gradient of the model's input for a step whose backward has finished (asked for at forward)."""
        return await fetch_tensor(self.stages[0], self.key(step), INPUT_GRADIENT)

    def forget(self, up_to_step: int) -> None:
        """Abandons the Backward calls opened for steps up to `up_to_step` that never ran backward."""
        self._backward_calls.abandon_where(lambda step: step <= up_to_step)

    def step_request(self, step: int, zero_grad: bool, optimizer_step: int,
                     backward_steps: Sequence[int]) -> shard_pb2.StepRequest:
        """An optimizer step, to send on its own or with the next forward."""
        return shard_pb2.StepRequest(deployment_id=self.deployment_id, step=step, zero_grad=zero_grad,
                                     optimizer_step=optimizer_step, backward_steps=backward_steps)

    async def step(self, request: shard_pb2.StepRequest) -> None:
        """Every stage applies its optimizer once its share of the request's backwards has succeeded."""
        await asyncio.gather(*(stage.call("Step", request) for stage in self.stages))

    async def read_state(self) -> dict[str, torch.Tensor]:
        """Every stage's weights, merged under the user's state-dict keys."""
        request = shard_pb2.ReadStateRequest(deployment_id=self.deployment_id)
        parts = await asyncio.gather(*(wire.collect(stage.stream("ReadState", request)) for stage in self.stages))
        return {key: value for part in parts for key, value in part.items()}

    async def load_state(self, per_stage: Sequence[dict[str, torch.Tensor]]) -> None:
        """Sends each stage its share of a state dict."""
        header = shard_pb2.LoadStateHeader(deployment_id=self.deployment_id)
        await asyncio.gather(*(
            stage.call("LoadState", wire.framed(shard_pb2.LoadStateRequest, header, tensors))
            for stage, tensors in zip(self.stages, per_stage)))

    async def describe(self) -> list[shard_pb2.DescribeResponse]:
        """What each stage's shard reports about itself."""
        return list(await asyncio.gather(*(s.call("Describe", shard_pb2.DescribeRequest()) for s in self.stages)))

    async def close(self) -> None:
        """Closes every channel."""
        self._backward_calls.abandon_where(lambda step: True)
        await asyncio.gather(*(stage.close() for stage in self.stages))
        if self._segments is not None:
            self._segments.close()


def split_state(state: dict[str, torch.Tensor], owners: dict[str, int], num_stages: int,
                strict: bool) -> list[dict[str, torch.Tensor]]:
    """Groups a state dict by the stage that owns each key; InvalidArgument on unknown or (if strict) missing keys."""
    unknown = sorted(set(state) - set(owners))
    missing = sorted(set(owners) - set(state))
    if unknown or (strict and missing):
        raise InvalidArgument(f"state dict does not match the model: unexpected keys {unknown[:10]}, "
                              f"missing keys {missing[:10]}")
    per_stage: list[dict[str, torch.Tensor]] = [{} for _ in range(num_stages)]
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise InvalidArgument(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor")
        per_stage[owners[key]][key] = value
    return per_stage
