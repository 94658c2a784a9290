"""A shard's side of the Link streams (shardtrain/link_streams.py): every item a link brings starts its work here.

A forward runs the stage and sends the activation on to the next stage (the last stage sends the output to the
SDK), a backward runs the stage's backward and sends the input gradient to the previous stage (the first stage
tells the SDK it is done); both go through the stage's executor (executor.py), which runs a planned step's
actions (planned_dispatch.py) too. Residuals go straight from their producer to their consumers and their gradients
straight back. An optimizer step is passed down the stages at once and each stage applies it after its own
backwards (optimizer_steps.py).

Outcomes travel as items too, so no stage waits for an answer:
- a failure goes toward the SDK in place of what the SDK waits for (a forward's toward the last stage,
  a backward's toward the first, and through every stage it passes, which then will not step on it);
- a link to the next stage that breaks while both stages live may lose a verdict: the stage opens it again
  and sends its last verdicts first (verdicts.py); the next stage takes each once, and runs no forward before
  the steps whose verdicts came before it.
- Nothing says "done" on its own: the next output tells the SDK that every stage settled the
  optimizer step before it (each forward waits for it), and a Flush item asks when nothing will.
  That also ends the backwards the step lists, so the first stage sends no backward_done for a
  backward that ends after such a step reached it (unless it carries the input's gradient).

Everything of a deployment is made new when the next one is loaded (_Deployment), not cleared by hand.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from shard_service import data_reads
from shard_service.call_outbox import CallOutbox
from shard_service.executor import StageExecutor
from shard_service.held import tensor_bytes
from shard_service.optimizer_steps import OptimizerSteps
from shard_service.peers import Peers
from shard_service.per_call_rpcs import PerCallRPCs
from shard_service.planned_dispatch import PlannedRuns
from shard_service.shard import Shard
from shard_service.sends import StageSends
from shard_service.stage_links import StageLinks
from shard_service.tied import TiedGradients
from shardtrain import errors, link_streams, wire
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.shard.loop")
_ROLES = shard_pb2.LinkRole
REOPEN_DELAYS = (0.0, 0.2, 0.5, 1.0, 2.0)  # before each attempt to reopen a broken link to the next stage


class _Deployment:
    """The state of one deployment on this shard: its links and what its items started."""

    def __init__(self, loop: LinkedLoop, deployment_id: str):
        shard = loop.shard
        self.id = deployment_id
        self.verdicts = shard.deployment.verdicts  # the step items this stage took, and the last ones passed down
        self.links = StageLinks(shard, loop.peers, deployment_id, loop.on_item, loop.broke,
                                lambda: self.verdicts.passed)
        self.sends = StageSends(shard, self.links)
        self.executor = StageExecutor(shard, shard.stage if deployment_id else None, self.sends)
        self.runs = PlannedRuns(self.executor, loop.spawn)
        self.tied = TiedGradients(shard, self.links)
        self.steps = OptimizerSteps(shard, self.sends, self.tied, self.verdicts, self.runs.run_of)
        self.per_call = PerCallRPCs(self.executor, self.steps, self.tied, self.verdicts)
        # a link to the next stage opened again -> which attempt
        self.reopening: dict[link_streams.ClientLink, int] = {}
        self.unread = shard.deployment.unread  # steps whose data rows could not be read here: their items drop


class LinkedLoop:
    """The links of one shard for its current deployment, and the work their items start."""

    def __init__(self, shard: Shard, peers: Peers):
        self.shard = shard
        self.peers = peers  # the channels to other shards that this stage's links are opened on
        shard.forgetters.append(self.forget)
        self._tasks: set[asyncio.Task] = set()
        self._reads = data_reads.DataReads(shard.settings.data_roots)  # items naming rows of data: read here
        self._now = _Deployment(self, "")

    async def reset(self, deployment_id: str) -> None:
        """A new stage was loaded: links of the previous deployment end, its work still waiting ends (and lets go
        of what it holds), and nothing of theirs is reported."""
        for task in list(self._tasks):
            task.cancel()
        links = self._now.links
        self._now = _Deployment(self, deployment_id)
        await links.close()

    async def close(self) -> None:
        """Ends the links this stage opened and the work in progress."""
        await self.reset("")

    def forget(self, up_to_step: int) -> None:
        """Drops what is left of steps up to `up_to_step`: residuals no forward took, runs, targets, outputs."""
        now = self._now
        now.executor.forget(up_to_step)
        now.runs.forget(up_to_step)
        now.links.forget(up_to_step)

    @property
    def calls(self) -> CallOutbox:
        """Where the per-call RPCs' results wait for FetchTensor."""
        return self._now.links.calls

    @property
    def per_call(self) -> PerCallRPCs:
        """The per-call RPCs of the current deployment."""
        return self._now.per_call

    @property
    def client_attached(self) -> bool:
        """The SDK has its input or output link open here: the deployment's client is there."""
        return self._now.links.input is not None or self._now.links.output is not None

    # --- links ---------------------------------------------------------------------------------------
    def opened(self, opening: shard_pb2.LinkOpen, end: link_streams.LinkEnd) -> None:
        """Someone opened a Link here: the SDK (input or output side) or another stage."""
        self.shard.stage_for(opening.deployment_id)
        self._now.links.opened(opening, end)

    def closed(self, end: link_streams.LinkEnd) -> None:
        """A Link opened here ended; if it came from a stage of this deployment, that stage went away or its link
        broke, and the SDK hears of it. (Whether the stage closed the link or died, this end cannot tell reliably:
        link.serve.)"""
        if self._now.links.closed(end):
            error = errors.Unavailable(f"{end.name} is unavailable: its link to this shard ended")
            self._tell_soon(self._break_item(error), up=False)

    def _break_item(self, error: errors.ShardtrainError) -> shard_pb2.LinkMessage:
        """The SDK hears that a link of this stage broke: it fails the steps this stage ran a forward for, whose items
        may have been on it, and no later one. A later step opens the link again (or fails by itself if the stage
        is gone); without the bound, a report the SDK read after the failure it caused failed the next step too."""
        return link_streams.error_item(None, error, self.shard.location, through_step=self._now.executor.forwarded)

    def broke(self, client: link_streams.ClientLink, error: errors.ShardtrainError) -> None:
        """A link this stage opened broke: the backwards and residual gradients it would bring back for the steps
        sent on it will not come, so those steps' optimizer steps are refused here; the SDK hears why."""
        now, address, next_address = self._now, client.peer.address, self.shard.plan.next_address
        if now.links.opened_here.get(address) is not client:
            return
        # A link opened again only to resend verdicts, which the next stage never accepted: the SDK heard already.
        attempt = now.reopening.pop(client, None)
        quiet = attempt is not None and not client.accepted
        self.spawn(self.shard.order.backwards_lost(now.executor.forwarded, str(error)))
        if address == next_address:
            now.runs.next_link_broke(f"the link to {client.name} broke: {error}")
        if not quiet:
            log.warning("%s: the link to %s broke: %s", self.shard.location, client.name, error,
                        extra=self.shard.fields())
            self._tell_soon(self._break_item(error), up=True)
        if address != next_address or not now.verdicts.passed or not (client.accepted or quiet):
            return
        # A verdict this stage passed down may have been lost with the link: the step would stand here and not on
        # the stages after. The link opens again now, not with the next forward, so that they have it when the
        # SDK next reads their weights; a few times, while the channel reconnects. (Not for a link the next stage
        # never accepted in the first place: it is gone.)
        attempt = 0 if client.accepted else attempt + 1
        if attempt < len(REOPEN_DELAYS):
            self.spawn(self._reopen(address, attempt))

    async def _reopen(self, address: str, attempt: int) -> None:
        """Opens the link to the next stage again after REOPEN_DELAYS[attempt], unless something opened it meanwhile."""
        now = self._now
        await asyncio.sleep(REOPEN_DELAYS[attempt])
        current = now.links.opened_here.get(address)
        if self._now is not now or (current is not None and current.broken is None):
            return
        now.reopening[now.links.client(address, _ROLES.LINK_ROLE_NEXT)] = attempt

    def _tell_soon(self, item: shard_pb2.LinkMessage, up: bool) -> None:
        """Tells (sends.tell) from a callback. Dropped if a new deployment came first: the old one's news would open
        its links, and a failure passed up a link the SDK's first item never travelled would stop halfway."""
        now = self._now

        async def tell() -> None:
            if self._now is now:
                await now.sends.tell(item, up)
        self.spawn(tell())

    # --- tasks -----------------------------------------------------------------------------------------
    def spawn(self, coroutine) -> asyncio.Task:
        """Runs link work as a task (tasks start in the order their items came), ended by a new deployment."""
        task = asyncio.ensure_future(self._logged(coroutine))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _spawn_held(self, coroutine, key: shard_pb2.StepKey, tensor: torch.Tensor | None, backward: bool) -> None:
        """spawn for a forward or backward, counted while it holds its tensor; refused beyond the held bound."""
        size, held = tensor_bytes(tensor), self._now.executor.held
        try:
            held.hold(size, item=True)
        except errors.ResourceExhausted as error:
            coroutine.close()
            self.spawn(self._now.sends.report(key, error, backward))
            return

        async def counted() -> None:
            try:
                await coroutine
            finally:
                held.release(size, item=True)
        self.spawn(counted())

    async def settled(self, timeout: float) -> None:
        """Returns once the work the items started has ended, what it started in turn included; DeadlineExceeded
        after `timeout` seconds. (For callers that drive the loop item by item, as tests do.)"""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._tasks:
            left = deadline - asyncio.get_running_loop().time()
            _, pending = await asyncio.wait(set(self._tasks), timeout=max(left, 0))
            if pending:
                raise errors.DeadlineExceeded(f"{len(pending)} pieces of link work still ran after {timeout:g} s")

    async def _logged(self, coroutine) -> None:
        """Runs one piece of link work; what escapes it is logged."""
        try:
            await coroutine
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the work reports its own failures; this is a last resort
            log.error("%s: link work failed: %r", self.shard.location, error, extra=self.shard.fields())

    # --- items -----------------------------------------------------------------------------------------
    def on_item(self, end: link_streams.LinkEnd, message: shard_pb2.LinkMessage, tensor: torch.Tensor | None) -> None:
        """Starts the work an item asks for, as a task: the reader goes on reading meanwhile."""
        now = self._now
        if end.deployment_id != now.id:
            raise errors.FailedPrecondition(f"this link was opened for deployment {end.deployment_id!r}; this shard "
                                            f"holds {now.id!r} now")
        rows = data_reads.rows_of(message)
        if rows is not None:
            self.spawn(self._read_then(end, message, rows, tensor, now.verdicts.last))
            return
        self._dispatch(end, message, tensor, now.verdicts.last)

    def _dispatch(self, end: link_streams.LinkEnd, message: shard_pb2.LinkMessage, tensor: torch.Tensor | None,
                  verdict: int) -> None:
        """on_item's work for an item with its tensor; `verdict`: the last step verdict taken when it came."""
        now, kind = self._now, message.WhichOneof("item")
        if kind == "forward" and message.forward.HasField("plan"):
            # As the loop's forwards: none runs before the steps whose verdicts came before it.
            header = message.forward
            header.after_optimizer_step = max(header.after_optimizer_step, verdict)
            now.runs.item(header.key, (header, tensor), backward=False)
        elif kind == "backward" and message.backward.key.step in now.runs:
            now.runs.item(message.backward.key, (message.backward, tensor), backward=True)
        elif kind == "target":
            now.runs.target(end, message.target, tensor)
        elif kind == "forward":
            self._spawn_held(now.executor.loop_forward(message.forward, tensor, verdict), message.forward.key,
                             tensor, backward=False)
        elif kind == "backward":
            self._spawn_held(now.executor.loop_backward(message.backward, tensor), message.backward.key, tensor,
                             backward=True)
        elif kind == "step":
            self._step_item(end, message.step)
        elif kind == "flush":
            self.spawn(now.steps.flush(message.flush))
        elif kind == "residual":
            key = message.residual.key
            now.executor.residuals.put((key.step, key.microbatch, message.residual.name), tensor)
        elif kind == "residual_gradient":
            item = message.residual_gradient
            self.spawn(self.shard.accumulate(item.key, item.name, tensor))
        elif kind == "tied_gradient":
            now.tied.arrived(message.tied_gradient, tensor)
        elif kind == "run_done":
            now.runs.after_run(message.run_done.key.step, "")
        elif kind == "error":
            self.spawn(self._pass_error(end, message))
        else:
            raise errors.InvalidArgument(f"a shard takes no {kind} item on a Link")

    def _step_item(self, end: link_streams.LinkEnd, item: shard_pb2.LinkStep) -> None:
        """An optimizer step's verdict: taken once (one sent again over a new link may come twice)."""
        now, request = self._now, item.request
        from_sdk = end is now.links.input
        if not now.verdicts.take(request.optimizer_step) and not from_sdk:
            log.debug("%s: optimizer step %d's verdict came again (over a new link); taken once already",
                      self.shard.location, request.optimizer_step)
            return
        if from_sdk and request.backwards_end_with_step:
            now.sends.ended_by_step.update(request.backward_steps)
        self.spawn(now.steps.step(item))

    async def _read_then(self, end: link_streams.LinkEnd, message: shard_pb2.LinkMessage, rows: shard_pb2.DataRows,
                         tensor: torch.Tensor | None, verdict: int) -> None:
        """An item naming rows of training data: the rows read from storage, then the item handled as if it had
        brought them. A read that fails fails the item's step here, as its forward failing would."""
        now, kind = self._now, message.WhichOneof("item")
        item = getattr(message, kind)
        key = item.key
        try:
            if tensor is not None:
                raise errors.InvalidArgument(f"a {kind} item names data rows or carries a tensor, not both")
            if end is not (now.links.output if kind == "target" else now.links.input):
                raise errors.InvalidArgument(f"data rows come on the SDK's {'output' if kind == 'target' else 'input'}"
                                             " link, to the stage that reads them")
            stage = self.shard.stage_for(key.deployment_id)

            def check(header) -> None:
                self.shard.fits(header)
                if kind == "forward":
                    stage.expect_input(header)
                now.executor.held.check(tensor_bytes(wire.meta(header)))
            tensor = await self._reads.read(rows, check)
            if key.step in now.unread:
                return  # another of the step's reads failed: the step failed here already
            item.ClearField("data")  # a forward's header goes on to the next stage, which reads nothing
            self._dispatch(end, message, tensor, verdict)
        except Exception as error:  # noqa: BLE001 - reported to the SDK, which waits for this step
            if key.step in now.unread:
                return
            now.unread.add(key.step)
            if not now.runs.abort(key.step, str(error)) and key.step not in now.runs and \
                    key.step > now.executor.forwarded:
                await self.shard.order.backward_finished(key.step, str(error))  # no backward will run here
            await now.sends.report(key, error, backward=False)

    async def _pass_error(self, end: link_streams.LinkEnd, message: shard_pb2.LinkMessage) -> None:
        """Passes a failure on the way it travels. A failed backward coming up counts as failed here, and so does
        a failed forward coming down: this stage will run no backward for that step (a planned step's optimizer
        step waits for one, even where no item of the step ever arrived)."""
        now, error = self._now, message.error
        from_below = not end.toward_first
        aborted = error.HasField("key") and now.runs.abort(error.key.step, error.message)
        last_stage = not self.shard.plan.next_address
        if error.HasField("key") and not from_below and last_stage and now.links.output is None:
            # A forward that failed before it reached the last stage, with no SDK here to hear of it: a client of
            # the per-call RPCs started it, and fetches its output from here.
            now.links.by_call.add(error.key.step)
        if error.HasField("key") and from_below:
            now.runs.after_run(error.key.step, error.message)
        if error.HasField("key") and error.backward == from_below and not aborted:
            await self.shard.order.backward_finished(error.key.step, error.message)
        await now.sends.tell(message, up=from_below, either_way=False)
