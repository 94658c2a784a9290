"""Weights tied across stages (an embedding and the output layer that shares it): before each optimizer step every
stage holding one sends its gradient to the others and replaces its own with the sum over all of them, added in
stage order, so that every copy gets the same bits and the copies stay equal."""

from __future__ import annotations

import torch

from shard_service.mailbox import Mailbox
from shard_service.shard import summed
from shard_service.stage_links import StageLinks
from shard_service.verdicts import VERDICTS_KEPT
from shardtrain.v1 import shard_pb2

_ROLES = shard_pb2.LinkRole


class TiedGradients:
    """The other stages' gradients of this stage's tied weights, and their sums, for one deployment."""

    def __init__(self, shard, links: StageLinks):
        self._shard, self._links = shard, links
        self._arrived = Mailbox()  # other stages' gradients, by (optimizer step, key, stage)
        self._summed: set[int] = set()  # optimizer steps whose tied gradients are summed here already

    def arrived(self, item: shard_pb2.TiedGradient, tensor: torch.Tensor | None) -> None:
        """Another stage's gradient of a tied weight came."""
        self._arrived.put((item.optimizer_step, item.key, item.from_stage), tensor)

    async def sum(self, stage, optimizer_step: int) -> None:
        """Before optimizer step `optimizer_step`: sends this stage's gradient of each tied weight to the other
        stages holding it and replaces its own with the sum. Once per optimizer step (clip_grad_norm_ may have
        done it)."""
        plan = self._shard.plan
        if not plan.tied or optimizer_step in self._summed:
            return
        self._summed = {number for number in self._summed if number > optimizer_step - VERDICTS_KEPT}
        self._summed.add(optimizer_step)
        for tie in plan.tied:
            await self._send(stage, tie, optimizer_step)
        for tie in plan.tied:
            grads = [stage.weights.tied_gradient(tie.key) if other == plan.stage else
                     await self._gradient_of(other, tie.key, optimizer_step) for other in tie.stages]
            total = summed([grad.to(stage.device) if grad is not None else None for grad in grads])
            await self._shard.run(stage.weights.set_tied_gradient, tie.key, total)

    async def _send(self, stage, tie, optimizer_step: int) -> None:
        plan = self._shard.plan
        item = shard_pb2.LinkMessage(tied_gradient=shard_pb2.TiedGradient(
            optimizer_step=optimizer_step, key=tie.key, from_stage=plan.stage))
        for other, address in zip(tie.stages, tie.addresses):
            if other != plan.stage:
                # To a later stage as a residual link (it may carry the next stage's items too), to an earlier
                # one on a link of its own.
                role = _ROLES.LINK_ROLE_RESIDUAL if other > plan.stage else _ROLES.LINK_ROLE_TIED
                await self._links.send(self._links.client(address, role), item, stage.weights.tied_gradient(tie.key),
                                       "exact")

    async def _gradient_of(self, other: int, key: str, optimizer_step: int) -> torch.Tensor | None:
        what = f"stage {other}'s gradient of tied weight {key!r} for optimizer step {optimizer_step}"
        return await self._arrived.take((optimizer_step, key, other), self._shard.settings.timeouts.peer_wait,
                                        what)
