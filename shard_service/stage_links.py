"""The Links of one stage in one deployment: who opened which link here, the links this stage opened, and the way
an item takes toward the first stage or the last (and on to the SDK, or to the per-call RPCs' outbox)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from shard_service.call_outbox import CallOutbox
from shard_service.peers import Peers
from shardtrain import errors, link_streams
from shardtrain.v1 import shard_pb2

_ROLES = shard_pb2.LinkRole


class StageLinks:
    """The link registry of a stage for its deployment; recreated per deployment. `on_item` handles what a link
    brings, `on_broken` hears of a link this stage opened that broke, `first_items` gives what a new link to the
    next stage sends first."""

    def __init__(self, shard, peers: Peers, deployment_id: str, on_item: Callable, on_broken: Callable,
                 first_items: Callable[[], list]):
        self._shard, self._peers, self.deployment_id = shard, peers, deployment_id
        self._on_item, self._on_broken, self._first_items = on_item, on_broken, first_items
        self.input: link_streams.LinkEnd | None = None    # the SDK's input link (first stage)
        self.output: link_streams.LinkEnd | None = None   # the SDK's output link (last stage)
        self._output_opened = asyncio.Event()     # the SDK opens it with the input link; it may arrive later
        self.from_stage: dict[int, link_streams.LinkEnd] = {}  # links other stages opened to this one
        self.opened_here: dict[str, link_streams.ClientLink] = {}  # links this stage opened, by address
        self.calls = CallOutbox()  # the SDK's part for steps a Forward call started, ...
        self.by_call = shard.deployment.by_call  # ... which are these (the deployment's runtime keeps them)

    def opened(self, opening: shard_pb2.LinkOpen, end: link_streams.LinkEnd) -> None:
        """Someone opened a Link here: the SDK (input or output side) or another stage."""
        plan = self._shard.plan
        end.expect = self._expect
        end.toward_first = opening.role != _ROLES.LINK_ROLE_OUTPUT
        if opening.role == _ROLES.LINK_ROLE_INPUT and plan.stage == 0:
            self.input = end
        elif opening.role == _ROLES.LINK_ROLE_OUTPUT and plan.stage == plan.num_stages - 1:
            self.output = end
            self._output_opened.set()
        elif opening.role == _ROLES.LINK_ROLE_TIED and \
                any(opening.from_stage in tie.stages and opening.from_stage > plan.stage for tie in plan.tied):
            end.name = f"stage {opening.from_stage} (a tied weight's gradients)"
        elif opening.role in (_ROLES.LINK_ROLE_NEXT, _ROLES.LINK_ROLE_RESIDUAL) and \
                0 <= opening.from_stage < plan.stage:
            self.from_stage[opening.from_stage] = end
            end.name = f"shard at {self._address_of(opening.from_stage)} (stage {opening.from_stage})"
        else:
            raise errors.InvalidArgument(
                f"stage {plan.stage} of {plan.num_stages} takes no {_ROLES.Name(opening.role)} link from "
                f"{'the SDK' if opening.from_stage < 0 else f'stage {opening.from_stage}'}")

    def _address_of(self, stage: int) -> str:
        plan = self._shard.plan
        addresses = {r.producer_stage: r.producer_address for r in plan.incoming_residuals}
        if plan.previous_address:
            addresses[plan.stage - 1] = plan.previous_address
        return addresses.get(stage, "?")

    def _expect(self, message: shard_pb2.LinkMessage, header) -> None:
        """Refuses an item's tensor larger than a stage here may hold, before any of it is stored (the rest of its
        checks come with the item's work: a refusal here ends the link)."""
        self._shard.fits(header)

    def closed(self, end: link_streams.LinkEnd) -> list[int]:
        """Forgets a Link opened here that ended; the stages of this deployment it came from."""
        stages = [stage for stage, known in self.from_stage.items() if known is end]
        for stage in stages:
            del self.from_stage[stage]
        if end is self.input:
            self.input = None
        if end is self.output:
            self.output = None
            self._output_opened.clear()
        return stages if end.deployment_id == self.deployment_id else []

    def client(self, address: str, role: int) -> link_streams.ClientLink:
        """The Link this stage opened to `address`, opened again if it broke."""
        client = self.opened_here.get(address)
        if client is None or client.broken is not None:
            peer = self._peers.peer(address)
            settings = self._shard.settings
            opening = shard_pb2.LinkOpen(deployment_id=self.deployment_id, role=role,
                                         from_stage=self._shard.plan.stage, shared_memory=peer.same_host,
                                         local_carrier=peer.same_host and settings.local_links,
                                         tcp_carrier=not peer.same_host and settings.tcp_links)
            # A link to the next stage starts with the last verdicts passed down: one may have been lost with the
            # link before (the next stage takes each verdict once).
            first = self._first_items() if address == self._shard.plan.next_address else ()
            client = link_streams.ClientLink(peer, opening, self._on_item, self._on_broken, first_items=first)
            client.expect = self._expect
            client.toward_first = False
            self.opened_here[address] = client
        return client

    def down(self, step: int | None = None) -> link_streams.LinkEnd | CallOutbox | None:
        """The way toward the last stage and on to the SDK (or, for a step a call started, to the call outbox)."""
        plan = self._shard.plan
        if plan.next_address:
            return self.client(plan.next_address, _ROLES.LINK_ROLE_NEXT)
        return self.calls if step in self.by_call else self.output

    def up(self, step: int | None = None) -> link_streams.LinkEnd | CallOutbox | None:
        """The way toward the first stage and on to the SDK (or the call outbox)."""
        plan = self._shard.plan
        if plan.stage > 0:
            return self.from_stage.get(plan.stage - 1)
        return self.calls if step in self.by_call else self.input

    async def send(self, end: link_streams.LinkEnd | CallOutbox | None, message: shard_pb2.LinkMessage,
                   tensor: torch.Tensor | None = None, kind: str = "activations") -> None:
        """Sends one item on `end`; Unavailable if there is no such link."""
        if end is None:
            raise errors.Unavailable(f"{self._shard.location}: no link to send a {message.WhichOneof('item')} on")
        await end.send(message, tensor, self._peers.options(end.same_host, kind))

    async def to_sdk(self, step: int | None = None) -> link_streams.LinkEnd | CallOutbox:
        """The last stage's way to the SDK, once the SDK opened its output link (up to the peer-wait deadline)."""
        end = self.down(step)
        if end is not None:
            return end
        timeout = self._shard.settings.timeouts.peer_wait
        try:
            await asyncio.wait_for(self._output_opened.wait(), timeout)
        except TimeoutError:
            raise errors.DeadlineExceeded(f"the SDK did not open its output link within {timeout:g} s") from None
        return self.down(step)

    def forget(self, up_to_step: int) -> None:
        """Drops the call outbox's leftovers of steps up to `up_to_step`."""
        self.calls.forget(up_to_step)

    async def close(self) -> None:
        """Ends the links this stage opened; what the calls kept goes."""
        opened, self.opened_here = self.opened_here, {}
        self.calls.forget(float("inf"))
        for client in opened.values():
            await client.close()
