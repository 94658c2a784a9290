"""What a stage's work sends, and which way: an activation on to the next stage (the last stage's output or loss to
the SDK), residuals straight to their consumers, gradients back, and failures toward the SDK. One implementation
for the loop's items and a planned step's actions alike."""

from __future__ import annotations

import logging

import torch

from shard_service.stage_links import StageLinks
from shardtrain import errors, link_streams
from shardtrain.residuals import CLIENT
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.shard.loop")
_ROLES = shard_pb2.LinkRole


class StageSends:
    """The sends of one stage's work over its links (stage_links.py)."""

    def __init__(self, shard, links: StageLinks):
        self._shard, self.links = shard, links
        self.ended_by_step = shard.deployment.ended_by_step  # first stage: backwards whose end a step reports

    async def activation(self, header: shard_pb2.ForwardHeader, output: torch.Tensor) -> None:
        """To the next stage, or (from the last stage) to the SDK as the output."""
        if self._shard.plan.next_address:
            await self.links.send(self.links.down(), shard_pb2.LinkMessage(forward=header), output)
            return
        item = shard_pb2.LinkMessage(output=shard_pb2.TensorKey(key=header.key))
        await self.links.send(await self.links.to_sdk(header.key.step), item, output)

    async def loss(self, key: shard_pb2.StepKey, loss: float) -> None:
        """A planned step's micro-batch loss, from the last stage to the SDK."""
        item = shard_pb2.LinkMessage(loss=shard_pb2.StepLoss(key=key, loss=loss))
        await self.links.send(await self.links.to_sdk(), item)

    async def residuals(self, key: shard_pb2.StepKey, outgoing: dict[str, torch.Tensor],
                        to_client: bool = True) -> None:
        """Each residual this stage produced, straight to every stage that consumes it, and with `to_client` the
        model's other outputs to the SDK (a planned step returns only its loss)."""
        for name, tensor in outgoing.items():
            sink = next(r for r in self._shard.plan.outgoing_residuals if r.name == name)
            item = shard_pb2.LinkMessage(residual=shard_pb2.TensorKey(key=key, name=name))
            for consumer, address in zip(sink.consumer_stages, sink.consumer_addresses):
                if consumer != CLIENT:
                    await self.links.send(self.links.client(address, _ROLES.LINK_ROLE_RESIDUAL), item, tensor,
                                          "residuals")
                elif to_client and key.step not in self.links.by_call:  # per-call RPCs carry no output but one
                    await self.links.send(await self.links.to_sdk(key.step), item, tensor, "activations")

    async def input_gradient(self, key: shard_pb2.StepKey, grad_input: torch.Tensor | None,
                             zero_grad: bool = False, planned: bool = False) -> None:
        """To the previous stage (which clears its gradients first when this one did), or (from the first stage of
        the loop) to the SDK as the end of the backward. A planned step's first stage sends none."""
        if self._shard.plan.stage > 0:
            item = shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=key, zero_grad=zero_grad))
        elif planned:
            return
        elif grad_input is None and key.step in self.ended_by_step:
            self.ended_by_step.discard(key.step)
            return  # the optimizer step that lists it tells the SDK
        else:
            item = shard_pb2.LinkMessage(backward_done=shard_pb2.TensorKey(key=key))
        await self.links.send(self.links.up(key.step), item, grad_input, "gradients")

    async def residual_gradients(self, key: shard_pb2.StepKey, grads: dict[str, torch.Tensor]) -> None:
        """The gradient of each residual this stage consumed, straight back to the stage that produced it."""
        for name, grad in grads.items():
            producer = self._shard.producer(name).producer_stage
            if producer == CLIENT:
                continue  # a model input: it takes no gradient
            item = shard_pb2.LinkMessage(residual_gradient=shard_pb2.TensorKey(key=key, name=name))
            await self.links.send(self.links.from_stage.get(producer), item, grad, "residuals")

    async def report(self, key: shard_pb2.StepKey, error: BaseException, backward: bool) -> None:
        """Sends a failure toward the SDK: a backward's up the stages, a forward's down."""
        await self.tell(link_streams.error_item(key, error, self._shard.location, backward), up=backward)

    async def tell(self, item: shard_pb2.LinkMessage, up: bool, either_way: bool = True) -> None:
        """Sends an error item up or down the stages; one that starts here goes the other way if that way is gone
        (one being passed on does not: it would come back)."""
        ways = [self.links.up, self.links.down] if up else [self.links.down, self.links.up]
        step = item.error.key.step if item.error.HasField("key") else None
        for way in ways if either_way else ways[:1]:
            try:
                await self.links.send(way(step), item)
                return
            except errors.ShardtrainError:
                continue
        log.warning("%s: nobody left to tell: %s", self._shard.location, item.error.message,
                    extra=self._shard.fields())

    async def pass_down(self, item: shard_pb2.LinkMessage) -> None:
        """Passes a step, flush or the like on toward the last stage; a failure to is logged (the SDK hears of the
        broken link on its own)."""
        try:
            await self.links.send(self.links.down(), item)
        except errors.ShardtrainError as error:
            log.warning("%s: could not pass on a %s item: %s", self._shard.location, item.WhichOneof("item"), error,
                        extra=self._shard.fields())
