"""A shard's side of the PyTorch-shaped loop over Link streams (shardtrain/link.py).

Every item a link brings is handled here: a forward runs the stage and sends the activation on to the
next stage (the last stage sends the output to the SDK), a backward runs the stage's backward and
sends the input gradient to the previous stage (the first stage tells the SDK it is done), residuals
go straight from their producer to their consumers and their gradients straight back. An optimizer
step is passed down the stages at once and each stage applies it after its own backwards.

Outcomes travel as items too, so no stage waits for an answer:
- a failure goes toward the SDK in place of what the SDK waits for (a forward's toward the last stage,
  a backward's toward the first, and through every stage it passes, which then will not step on it);
- an optimizer step goes down the stages: stage i passes it on once the backwards it follows are over
  on stage i, with the reason if one failed there or before, and applies it only if none did. The
  stages' weights never drift apart, and stage i+1 starts its optimizer while stage i runs its own.
- A link to the next stage that breaks while both stages live may lose a verdict: the stage opens it again
  and sends its last verdicts first (_Verdicts); the next stage takes each once, and runs no forward before
  the steps whose verdicts came before it.
- A planned step (model.train_step) runs on the same links and items: its forwards carry a StepPlan, and
  each stage runs its micro-batches' forwards and backwards in the order the schedule gives it (planned.py).
- Nothing says "done" on its own: the next output tells the SDK that every stage settled the
  optimizer step before it (each forward waits for it), and a Flush item asks when nothing will.
  That also ends the backwards the step lists, so the first stage sends no backward_done for a
  backward that ends after such a step reached it (unless it carries the input's gradient).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import torch

from shard_service import reads
from shard_service.calls import CallOutbox
from shard_service.mailbox import Mailbox
from shard_service.ordering import StepOrder
from shard_service.peers import Peers
from shard_service.planned import MAX_RUNS, PlannedRun, StagePorts, tensor_bytes
from shard_service.runtime import ShardRuntime, summed
from shard_service.stage import Stage
from shardtrain import errors, link, wire
from shardtrain.residuals import CLIENT
from shardtrain.rpc import status_message
from shardtrain.v1 import shard_pb2


log = logging.getLogger("shardtrain.shard.loop")
_ROLES = shard_pb2.LinkRole
# Forwards and backwards a stage holds at once, tensors and all, while they wait to run (for the optimizer step
# they follow, a residual, the compute thread): the loop has one or two, a script that never steps could pile
# up any number. Beyond either bound the item is refused with RESOURCE_EXHAUSTED.
MAX_HELD_ITEMS = 128
MAX_HELD_BYTES = 2 << 30
REOPEN_DELAYS = (0.0, 0.2, 0.5, 1.0, 2.0)  # before each attempt to reopen a broken link to the next stage
STATS_KEPT = 8  # the StageStats of the last planned steps, for a Flush that asks for them
VERDICTS_KEPT = 4  # step items passed down, sent again over a new link to the next stage (a step settles before
                   # the forward after it runs, and the SDK runs at most one step ahead: the last one or two matter)


def _check_forward(header: shard_pb2.ForwardHeader, x: torch.Tensor | None) -> None:
    if x is None:
        raise errors.InvalidArgument("a forward item carries the activation tensor")
    if header.HasField("step_first"):
        raise errors.InvalidArgument("on a Link an optimizer step travels as a step item, not in step_first")


class LinkedLoop:
    """The links of one shard for its current deployment, and the work their items start."""

    def __init__(self, runtime: ShardRuntime, peers: Peers):
        self._runtime = runtime
        self._peers = peers  # the channels to other shards that this stage's links are opened on
        runtime.forgetters.append(self.forget)
        self._deployment_id = ""
        self._input: link.LinkEnd | None = None    # the SDK's input link (first stage)
        self._output: link.LinkEnd | None = None   # the SDK's output link (last stage)
        self._output_opened = asyncio.Event()      # the SDK opens it with the input link; it may arrive later
        self._from_stage: dict[int, link.LinkEnd] = {}  # links other stages opened to this one
        self._opened: dict[str, link.ClientLink] = {}   # links this stage opened, by address
        self._residuals = Mailbox()   # residuals pushed here by their producers, by (step, microbatch, name)
        self._forwarded = -1          # the highest step this stage ran a forward for (steps count from 0)
        self._ended_by_step: set[int] = set()  # first stage: backwards whose end an optimizer step reports
        self._verdicts = _Verdicts()  # the step items this stage took, and the last ones it passed down
        self._reopening: dict[link.ClientLink, int] = {}  # a link to the next stage opened again -> which attempt
        self._tasks: set[asyncio.Task] = set()
        self._held = [0, 0]  # forwards and backwards received and not yet run: how many, and their tensors' bytes
        self._runs: dict[int, PlannedRun] = {}  # planned steps, by step
        self._after_runs: dict[int, asyncio.Future] = {}  # replicated: step -> why the stages after failed it, or ""
        self._targets = Mailbox()     # last stage: a planned step's loss targets, by (step, microbatch)
        self._target_bytes = 0        # their tensors' bytes
        self._stats: dict[int, shard_pb2.StageStats] = {}  # optimizer step -> what its planned step did here
        self._tied = Mailbox()        # other stages' gradients of tied weights, by (optimizer step, key, stage)
        self._tied_summed: set[int] = set()  # optimizer steps whose tied gradients are summed here already
        self.calls = CallOutbox()     # the SDK's part for steps a Forward call started (keep_output), ...
        self._by_call: set[int] = set()  # ... which are these
        self._reads = reads.DataReads(runtime.settings.data_roots)  # items naming rows of data: read here
        self._unread: set[int] = set()  # steps whose data rows could not be read here: their other items are dropped

    # --- links ---------------------------------------------------------------------------------------
    async def reset(self, deployment_id: str) -> None:
        """A new stage was loaded: links of the previous deployment end, its work still waiting ends (and lets go
        of what it holds), and nothing of theirs is reported."""
        for task in list(self._tasks):
            task.cancel()
        self._deployment_id = deployment_id
        self._forwarded = -1
        self._ended_by_step.clear()
        self._verdicts = _Verdicts()
        self._reopening.clear()
        self._input = self._output = None
        self._output_opened.clear()
        self._from_stage.clear()
        opened, self._opened = self._opened, {}
        for client in opened.values():
            await client.close()
        self._residuals.discard_where(lambda key: True)
        self._runs.clear()
        self._after_runs.clear()
        self._tied.discard_where(lambda key: True)
        self._tied_summed.clear()
        self.calls.forget(float("inf"))
        self._by_call.clear()
        self._unread.clear()
        self._targets.discard_where(lambda key: True)
        self._target_bytes = 0
        self._stats.clear()

    def _expect(self, message: shard_pb2.LinkMessage, header) -> None:
        """Refuses an item's tensor larger than a stage here may hold, before any of it is stored (the rest of its
        checks come with the item's work: a refusal here ends the link)."""
        self._runtime.fits(header)

    @property
    def client_attached(self) -> bool:
        """The SDK has its input or output link open here: the deployment's client is there."""
        return self._input is not None or self._output is not None

    def opened(self, opening: shard_pb2.LinkOpen, end: link.LinkEnd) -> None:
        """Someone opened a Link here: the SDK (input or output side) or another stage."""
        self._runtime.stage_for(opening.deployment_id)
        plan = self._runtime.plan
        end.expect = self._expect
        end.toward_first = opening.role != _ROLES.LINK_ROLE_OUTPUT
        if opening.role == _ROLES.LINK_ROLE_INPUT and plan.stage == 0:
            self._input = end
        elif opening.role == _ROLES.LINK_ROLE_OUTPUT and plan.stage == plan.num_stages - 1:
            self._output = end
            self._output_opened.set()
        elif opening.role == _ROLES.LINK_ROLE_TIED and \
                any(opening.from_stage in tie.stages and opening.from_stage > plan.stage for tie in plan.tied):
            end.name = f"stage {opening.from_stage} (a tied weight's gradients)"
        elif opening.role in (_ROLES.LINK_ROLE_NEXT, _ROLES.LINK_ROLE_RESIDUAL) and \
                0 <= opening.from_stage < plan.stage:
            self._from_stage[opening.from_stage] = end
            addresses = {r.producer_stage: r.producer_address for r in plan.incoming_residuals}
            if plan.previous_address:
                addresses[plan.stage - 1] = plan.previous_address
            end.name = f"shard at {addresses.get(opening.from_stage, '?')} (stage {opening.from_stage})"
        else:
            raise errors.InvalidArgument(
                f"stage {plan.stage} of {plan.num_stages} takes no {_ROLES.Name(opening.role)} link from "
                f"{'the SDK' if opening.from_stage < 0 else f'stage {opening.from_stage}'}")

    def closed(self, end: link.LinkEnd) -> None:
        """A Link opened here ended; if it came from a stage of this deployment, that stage went away or its link
        broke, and the SDK hears of it. (Whether the stage closed the link or died, this end cannot tell reliably:
        link.serve.)"""
        current = end.deployment_id == self._deployment_id
        stages = [stage for stage, known in self._from_stage.items() if known is end]
        for stage in stages:
            del self._from_stage[stage]
        if end is self._input:
            self._input = None
        if end is self._output:
            self._output = None
            self._output_opened.clear()
        if current and stages:
            error = errors.Unavailable(f"{end.name} is unavailable: its link to this shard ended")
            self._tell_soon(self._break_item(error), up=False)

    def _break_item(self, error: errors.ShardtrainError) -> shard_pb2.LinkMessage:
        """The SDK hears that a link of this stage broke: it fails the steps this stage ran a forward for, whose items
        may have been on it, and no later one. A later step opens the link again (or fails by itself if the stage
        is gone); without the bound, a report the SDK read after the failure it caused failed the next step too."""
        return link.error_item(None, error, self._runtime.location, through_step=self._forwarded)

    def _client(self, address: str, role: int) -> link.ClientLink:
        """The Link this stage opened to `address`, opened again if it broke."""
        client = self._opened.get(address)
        if client is None or client.broken is not None:
            peer = self._peers.peer(address)
            settings = self._runtime.settings
            opening = shard_pb2.LinkOpen(deployment_id=self._deployment_id, role=role,
                                         from_stage=self._runtime.plan.stage, shared_memory=peer.same_host,
                                         local_carrier=peer.same_host and settings.local_links,
                                         tcp_carrier=not peer.same_host and settings.tcp_links)
            # A link to the next stage starts with the last verdicts passed down: one may have been lost with the
            # link before (the next stage takes each verdict once).
            first = self._verdicts.passed if address == self._runtime.plan.next_address else ()
            client = link.ClientLink(peer, opening, self.on_item, self._broke, first_items=first)
            client.expect = self._expect
            client.toward_first = False
            self._opened[address] = client
        return client

    def _broke(self, client: link.ClientLink, error: errors.ShardtrainError) -> None:
        """A link this stage opened broke: the backwards and residual gradients it would bring back for the steps
        sent on it will not come, so those steps' optimizer steps are refused here; the SDK hears why."""
        if self._opened.get(client.peer.address) is not client:
            return
        address = client.peer.address
        # A link opened again only to resend verdicts, which the next stage never accepted: the SDK heard already.
        attempt = self._reopening.pop(client, None)
        quiet = attempt is not None and not client.accepted
        self._spawn(self._runtime.order.backwards_lost(self._forwarded, str(error)))
        if address == self._runtime.plan.next_address:  # no run_done comes back on it for the steps under way
            for step in [step for step in self._runs if step <= self._forwarded]:
                self._after_run(step, f"the link to {client.name} broke: {error}")
        if not quiet:
            log.warning("%s: the link to %s broke: %s", self._runtime.location, client.name, error,
                        extra=self._runtime.fields())
            self._tell_soon(self._break_item(error), up=True)
        if address != self._runtime.plan.next_address or not self._verdicts.passed or not (client.accepted or quiet):
            return
        # A verdict this stage passed down may have been lost with the link: the step would stand here and not on
        # the stages after. The link opens again now, not with the next forward, so that they have it when the
        # SDK next reads their weights; a few times, while the channel reconnects. (Not for a link the next stage
        # never accepted in the first place: it is gone.)
        attempt = 0 if client.accepted else attempt + 1
        if attempt < len(REOPEN_DELAYS):
            self._spawn(self._reopen(address, attempt))

    async def _reopen(self, address: str, attempt: int) -> None:
        """Opens the link to the next stage again after REOPEN_DELAYS[attempt], unless something opened it meanwhile."""
        deployment = self._deployment_id
        await asyncio.sleep(REOPEN_DELAYS[attempt])
        current = self._opened.get(address)
        if self._deployment_id != deployment or (current is not None and current.broken is None):
            return
        self._reopening[self._client(address, _ROLES.LINK_ROLE_NEXT)] = attempt

    # --- sending ---------------------------------------------------------------------------------------
    def _down(self, step: int | None = None) -> link.LinkEnd | CallOutbox | None:
        """The way toward the last stage and on to the SDK (or, for a step a call started, to the call outbox)."""
        plan = self._runtime.plan
        if plan.next_address:
            return self._client(plan.next_address, _ROLES.LINK_ROLE_NEXT)
        return self.calls if step in self._by_call else self._output

    def _up(self, step: int | None = None) -> link.LinkEnd | CallOutbox | None:
        """The way toward the first stage and on to the SDK (or the call outbox)."""
        plan = self._runtime.plan
        if plan.stage > 0:
            return self._from_stage.get(plan.stage - 1)
        return self.calls if step in self._by_call else self._input

    async def _send(self, end: link.LinkEnd | None, message, tensor: torch.Tensor | None = None,
                    kind: str = "activations") -> None:
        if end is None:
            raise errors.Unavailable(f"{self._runtime.location}: no link to send a {message.WhichOneof('item')} on")
        await end.send(message, tensor, self._peers.options(end.same_host, kind))

    async def _report(self, key: shard_pb2.StepKey, error: BaseException, backward: bool) -> None:
        """Sends a failure toward the SDK: a backward's up the stages, a forward's down."""
        await self._tell(link.error_item(key, error, self._runtime.location, backward), up=backward)

    async def _tell(self, item: shard_pb2.LinkMessage, up: bool, either_way: bool = True) -> None:
        """Sends an error item up or down the stages; one that starts here goes the other way if that way is gone
        (one being passed on does not: it would come back)."""
        ways = [self._up, self._down] if up else [self._down, self._up]
        step = item.error.key.step if item.error.HasField("key") else None
        for way in ways if either_way else ways[:1]:
            try:
                await self._send(way(step), item)
                return
            except errors.ShardtrainError:
                continue
        log.warning("%s: nobody left to tell: %s", self._runtime.location, item.error.message,
                    extra=self._runtime.fields())

    def _tell_soon(self, item: shard_pb2.LinkMessage, up: bool) -> None:
        """_tell from a callback. Dropped if a new deployment came first: the old one's news would open its
        links, and a failure passed up a link the SDK's first item never travelled would stop halfway."""
        deployment = self._deployment_id

        async def tell() -> None:
            if self._deployment_id == deployment:
                await self._tell(item, up)
        self._spawn(tell())

    def _spawn(self, coroutine) -> None:
        """Runs link work as a task (tasks start in the order their items came), ended by a new deployment."""
        task = asyncio.ensure_future(self._logged(coroutine))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _spawn_held(self, coroutine, key: shard_pb2.StepKey, tensor: torch.Tensor | None, backward: bool) -> None:
        """_spawn for a forward or backward, counted while it holds its tensor; refused beyond MAX_HELD_*."""
        size = tensor_bytes(tensor)
        count, held = self._held
        if count >= MAX_HELD_ITEMS or held + size > MAX_HELD_BYTES:
            coroutine.close()
            error = errors.ResourceExhausted(
                f"{count} forwards and backwards ({held >> 20} MiB) already wait to run here, at most {MAX_HELD_ITEMS} "
                f"and {MAX_HELD_BYTES >> 20} MiB: a step waits for an optimizer step that has not come")
            self._spawn(self._report(key, error, backward))
            return
        self._held = [count + 1, held + size]

        async def counted() -> None:
            try:
                await coroutine
            finally:
                self._held = [self._held[0] - 1, self._held[1] - size]
        self._spawn(counted())

    async def _logged(self, coroutine) -> None:
        """Runs one piece of link work; what escapes it is logged."""
        try:
            await coroutine
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the work reports its own failures; this is a last resort
            log.error("%s: link work failed: %r", self._runtime.location, error, extra=self._runtime.fields())

    # --- items -----------------------------------------------------------------------------------------
    def on_item(self, end: link.LinkEnd, message: shard_pb2.LinkMessage, tensor: torch.Tensor | None) -> None:
        """Starts the work an item asks for, as a task: the reader goes on reading meanwhile."""
        if end.deployment_id != self._deployment_id:
            raise errors.FailedPrecondition(f"this link was opened for deployment {end.deployment_id!r}; this shard "
                                            f"holds {self._deployment_id!r} now")
        rows = reads.rows_of(message)
        if rows is not None:
            self._spawn(self._read_then(end, message, rows, tensor, self._verdicts.last))
            return
        self._dispatch(end, message, tensor, self._verdicts.last)

    def _dispatch(self, end: link.LinkEnd, message: shard_pb2.LinkMessage, tensor: torch.Tensor | None,
                  verdict: int) -> None:
        """on_item's work for an item with its tensor; `verdict`: the last step verdict taken when it came."""
        kind = message.WhichOneof("item")
        if kind == "forward" and message.forward.HasField("plan"):
            # As the loop's forwards: none runs before the steps whose verdicts came before it.
            header = message.forward
            header.after_optimizer_step = max(header.after_optimizer_step, verdict)
            self._planned_item(header.key, (header, tensor), backward=False)
        elif kind == "backward" and message.backward.key.step in self._runs:
            self._planned_item(message.backward.key, (message.backward, tensor), backward=True)
        elif kind == "target":
            self._target_item(end, message.target, tensor)
        elif kind == "forward":
            self._spawn_held(self._forward(message.forward, tensor, verdict), message.forward.key,
                             tensor, backward=False)
        elif kind == "backward":
            self._spawn_held(self._backward(message.backward, tensor), message.backward.key, tensor, backward=True)
        elif kind == "step":
            request = message.step.request
            if not self._verdicts.take(request.optimizer_step) and end is not self._input:
                log.debug("%s: optimizer step %d's verdict came again (over a new link); taken once already",
                          self._runtime.location, request.optimizer_step)
                return
            if end is self._input and request.backwards_end_with_step:
                self._ended_by_step.update(request.backward_steps)
            self._spawn(self._step(message.step))
        elif kind == "flush":
            self._spawn(self._flush(message.flush))
        elif kind == "residual":
            key = message.residual.key
            self._residuals.put((key.step, key.microbatch, message.residual.name), tensor)
        elif kind == "residual_gradient":
            self._spawn(self._runtime.accumulate(message.residual_gradient.key, message.residual_gradient.name,
                                               tensor))
        elif kind == "tied_gradient":
            item = message.tied_gradient
            self._tied.put((item.optimizer_step, item.key, item.from_stage), tensor)
        elif kind == "run_done":
            self._after_run(message.run_done.key.step, "")
        elif kind == "error":
            self._spawn(self._pass_error(end, message))
        else:
            raise errors.InvalidArgument(f"a shard takes no {kind} item on a Link")

    async def _read_then(self, end: link.LinkEnd, message: shard_pb2.LinkMessage, rows: shard_pb2.DataRows,
                         tensor: torch.Tensor | None, verdict: int) -> None:
        """An item naming rows of training data: the rows read from storage, then the item handled as if it had
        brought them. A read that fails fails the item's step here, as its forward failing would."""
        kind = message.WhichOneof("item")
        item = getattr(message, kind)
        key = item.key
        try:
            if tensor is not None:
                raise errors.InvalidArgument(f"a {kind} item names data rows or carries a tensor, not both")
            sdk_end = self._output if kind == "target" else self._input
            if end is not sdk_end:
                raise errors.InvalidArgument(f"data rows come on the SDK's {'output' if kind == 'target' else 'input'}"
                                             " link, to the stage that reads them")
            stage = self._runtime.stage_for(key.deployment_id)

            def check(header) -> None:
                self._runtime.fits(header)
                if kind == "forward":
                    stage.expect_input(header)
                self._check_room(wire.meta(header))
            tensor = await self._reads.read(rows, check)
            if key.step in self._unread:
                return  # another of the step's reads failed: the step failed here already
            item.ClearField("data")  # a forward's header goes on to the next stage, which reads nothing
            self._dispatch(end, message, tensor, verdict)
        except Exception as error:  # noqa: BLE001 - reported to the SDK, which waits for this step
            if key.step in self._unread:
                return
            self._unread.add(key.step)
            if not self._abort_run(key.step, str(error)) and key.step not in self._runs and key.step > self._forwarded:
                await self._runtime.order.backward_finished(key.step, str(error))  # no backward will run here
            await self._report(key, error, backward=False)

    # --- the per-call RPCs: adapters onto the same work, for clients without Links ---------------------------
    async def forward_call(self, header: shard_pb2.ForwardHeader, x: torch.Tensor | None) -> None:
        """A Forward call to the first stage: runs as the SDK's forward item would; the last stage keeps the output
        for FetchTensor. Raises this stage's failure; a later stage's is kept in the output's place."""
        self._check_end("Forward", first=True)
        header.keep_output = True
        error = await self._forward(header, x, self._verdicts.last)
        if error is not None:
            raise error

    async def backward_call(self, header: shard_pb2.BackwardHeader, grad: torch.Tensor | None) -> None:
        """A Backward call to the last stage: runs as the SDK's backward item would; the first stage keeps the
        input's gradient (or an earlier stage's failure) for FetchTensor. Raises this stage's failure."""
        self._check_end("Backward", first=False)
        error = await self._backward(header, grad)
        if error is not None:
            raise error

    async def step_call(self, request: shard_pb2.StepRequest) -> None:
        """A Step call to the first stage: the optimizer step goes down the stages as the SDK's step item does.
        FailedPrecondition if it was refused (a listed backward failed here or on a later stage)."""
        self._check_end("Step", first=True)
        if not self._verdicts.take(request.optimizer_step):
            raise errors.FailedPrecondition(f"optimizer step {request.optimizer_step} was settled already")
        failure = await self._step(shard_pb2.LinkStep(request=request))
        if failure:
            raise errors.FailedPrecondition(f"optimizer step {request.optimizer_step} not applied: {failure}")

    async def gradient_norm_call(self, request: shard_pb2.GradientNormRequest) -> tuple[float, list[float]]:
        """A GradientNorm call: the norm of this stage's gradients once the listed backwards are over here, after
        tied weights' gradients were summed for the optimizer step named (each then counted on its first stage)
        and the request's edits applied; and the norms of the parameters it names."""
        shard = self._runtime
        stage = shard.stage_for(request.deployment_id)
        await shard.backwards_over(request.backward_steps, "no gradient norm")
        if request.optimizer_step:
            await self._sum_tied(stage, request.optimizer_step)
        counted_elsewhere = [tie.key for tie in shard.plan.tied if tie.stages[0] != shard.plan.stage]
        norm_type = request.norm_type or 2.0

        def norms() -> tuple[float, list[float]]:
            stage.edit_gradients(request.edits)
            return stage.gradient_norm(norm_type, counted_elsewhere), stage.parameter_norms(norm_type,
                                                                                             request.parameters)
        return await shard.run(norms)

    def _check_end(self, call: str, first: bool) -> None:
        plan = self._runtime.plan
        wanted = 0 if first else plan.num_stages - 1
        if plan.stage != wanted:
            raise errors.FailedPrecondition(
                f"{call} goes to the {'first' if first else 'last'} stage (stage {wanted}); this shard holds stage "
                f"{plan.stage}, and the stages pass the work on themselves")
        if first and any(r.producer_stage == CLIENT for r in plan.incoming_residuals) or not first and any(
                CLIENT in r.consumer_stages for r in plan.outgoing_residuals):
            raise errors.FailedPrecondition(f"{call}: this deployment's model takes or returns several tensors; the "
                                            "per-call RPCs carry one each way: drive it over Links (the Python SDK)")

    # --- planned steps -------------------------------------------------------------------------------
    def _planned_item(self, key: shard_pb2.StepKey, item: tuple, backward: bool) -> None:
        """A micro-batch's forward or backward of a planned step, for its run (started by the step's first item)."""
        try:
            run = self._runs.get(key.step)
            if run is None:
                run = self._start_run(key, item[0].plan)
            if run.aborted:
                return  # the step failed; its other items are dropped
            self._check_room(item[1])
            run.deliver(key.microbatch, "backward" if backward else "forward", item)
        except errors.ShardtrainError as error:
            if key.step not in self._runs and key.step > self._forwarded:
                # The step could not start here (its plan was refused): its backward will never run, so its
                # optimizer step must be refused here rather than wait for it.
                self._spawn(self._runtime.order.backward_finished(key.step, str(error)))
            self._spawn(self._report(key, error, backward))

    def _start_run(self, key: shard_pb2.StepKey, plan: shard_pb2.StepPlan) -> PlannedRun:
        stage = self._runtime.stage_for(key.deployment_id)
        if key.step <= self._forwarded:
            raise errors.InvalidArgument(f"step {key.step} comes after step {self._forwarded} on this stage: "
                                         "steps count up")
        if sum(not run.done for run in self._runs.values()) >= MAX_RUNS:
            raise errors.ResourceExhausted(f"{MAX_RUNS} planned steps already run here; a step waits for an "
                                           "optimizer step that has not come")
        run = PlannedRun(self._ports(stage), key.step, plan)
        self._runs[key.step] = run
        self._forwarded = key.step
        task = asyncio.ensure_future(self._execute(run))
        run.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return run

    def _check_room(self, tensor: torch.Tensor | None) -> None:
        """ResourceExhausted if one more tensor of a planned step would pass the bound on the bytes a stage holds
        waiting. (Their count is bounded already: each micro-batch's item comes once, for at most MAX_RUNS steps.)"""
        size = tensor_bytes(tensor)
        held = self._held[1] + self._target_bytes + sum(run.held_bytes() for run in self._runs.values())
        if held + size > MAX_HELD_BYTES:
            raise errors.ResourceExhausted(
                f"{held >> 20} MiB of forwards, backwards and targets already wait to run here, at most "
                f"{MAX_HELD_BYTES >> 20} MiB: send fewer or smaller micro-batches at once")

    def _target_item(self, end: link.LinkEnd, target: shard_pb2.LossTarget, tensor: torch.Tensor | None) -> None:
        key = target.key
        try:
            if end is not self._output:
                raise errors.InvalidArgument("loss targets come from the SDK's output link to the last stage")
            if (tensor is None) != bool(target.loss.model_output):
                raise errors.InvalidArgument("a target item carries the target tensor, unless its loss is the model's "
                                             "own output (LossSpec.model_output), and then none")
            self._check_room(tensor)
            self._targets.put((key.step, key.microbatch), (target, tensor))
            self._target_bytes += tensor_bytes(tensor)
        except errors.ShardtrainError as error:
            self._spawn(self._report(key, error, backward=False))

    async def _execute(self, run: PlannedRun) -> None:
        """Runs a planned step's actions; a failure goes both ways (the stages before wait for gradients, those
        after for activations), and the step's backward counts as failed here, so no stage applies its step."""
        try:
            await run.execute()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - reported; the step's optimizer step is refused everywhere
            run.abort()
            key = shard_pb2.StepKey(deployment_id=self._deployment_id, step=run.step)
            await self._tell(link.error_item(key, error, self._runtime.location, backward=True), up=True,
                             either_way=False)
            await self._tell(link.error_item(key, error, self._runtime.location), up=False, either_way=False)
            await self._runtime.order.backward_finished(run.step, status_message(error, self._runtime.location)[1])
            return
        run.done = True
        replicated, plan = self._runtime.plan.num_replicas > 1, self._runtime.plan
        # Replicated: the step is over here once it is over on every stage after this one too (run_done).
        failure = await self._runs_after(run.step) if replicated and plan.next_address else ""
        await self._runtime.order.backward_finished(run.step, failure)
        if replicated and plan.stage > 0 and not failure:
            key = shard_pb2.StepKey(deployment_id=self._deployment_id, step=run.step)
            await self._send(self._up(run.step), shard_pb2.LinkMessage(run_done=shard_pb2.TensorKey(key=key)))

    def _after_run(self, step: int, failure: str) -> None:
        """The stages after this one finished planned step `step` ("") or failed it (why); the first word counts."""
        outcome = self._after_runs.setdefault(step, asyncio.get_running_loop().create_future())
        if not outcome.done():
            outcome.set_result(failure)

    async def _runs_after(self, step: int) -> str:
        """Why the stages after this one failed planned step `step`, or "" once they all finished it."""
        wait = self._runtime.settings.timeouts.peer_wait
        outcome = self._after_runs.setdefault(step, asyncio.get_running_loop().create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(outcome), wait)
        except TimeoutError:
            return f"the stages after this one did not finish step {step} within {wait:g} s"
        finally:
            self._after_runs.pop(step, None)

    def _abort_run(self, step: int, reason: str) -> bool:
        """Ends a planned step that failed on another stage; False if there is none running here."""
        run = self._runs.get(step)
        if run is None or run.done or run.aborted:
            return False
        run.abort()
        if run.task is not None:
            run.task.cancel()
        self._spawn(self._runtime.order.backward_finished(step, reason))
        return True

    def _ports(self, stage: Stage) -> StagePorts:
        shard = self._runtime
        wait = shard.settings.timeouts.peer_wait
        return StagePorts(
            stage=stage, index=shard.plan.stage, num_stages=shard.plan.num_stages,
            deployment_id=self._deployment_id, timeout=wait, simulate_compute=shard.settings.simulate_compute,
            run=shard.run, in_flight=lambda: len(stage.in_flight_steps), averager=shard.averager_call,
            averager_arm=shard.averager_arm, incoming_residuals=lambda key: self._incoming_residuals(stage, key),
            after_optimizer_step=lambda number: shard.order.after_optimizer_step(number, wait),
            target=self._target, loss=shard.loss, send_loss=self._send_loss, send_activation=self._send_activation,
            send_residuals=lambda key, outgoing: self._send_residuals(key, outgoing, to_client=False),
            no_client_gradients=lambda key: self._no_client_gradients(stage, key),
            residual_gradients=lambda key: shard.residual_gradients(stage, key),
            send_input_gradient=self._send_planned_gradient, send_residual_gradients=self._send_residual_gradients,
            device=shard.device, virtual_stages=max(shard.plan.virtual_stages, 1), forwarded=shard.steps.forward)

    async def _target(self, key: shard_pb2.StepKey) -> tuple[shard_pb2.LossTarget, torch.Tensor]:
        what = f"the target of step {key.step} micro-batch {key.microbatch}"
        entry = await self._targets.get((key.step, key.microbatch), self._runtime.settings.timeouts.peer_wait, what)
        self._targets.discard((key.step, key.microbatch))
        self._target_bytes -= tensor_bytes(entry[1])
        return entry

    async def _send_loss(self, key: shard_pb2.StepKey, loss: float) -> None:
        if self._output is None:
            await self._sdk_output()
        await self._send(self._output, shard_pb2.LinkMessage(loss=shard_pb2.StepLoss(key=key, loss=loss)))

    async def _send_planned_gradient(self, key: shard_pb2.StepKey, grad: torch.Tensor) -> None:
        await self._send(self._up(), shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=key)), grad,
                         "gradients")

    async def _forward(self, header: shard_pb2.ForwardHeader, x: torch.Tensor | None,
                       after_verdict: int = 0) -> BaseException | None:
        """Runs the stage's forward once the optimizer step the SDK names has settled here, and every step whose
        verdict came before this forward (the SDK stops naming one after a failure, when a verdict sent again
        over a new link may still come first), then sends the activation and residuals on. Returns the failure
        it reported, if any."""
        shard = self._runtime
        if header.keep_output:
            self._by_call.add(header.key.step)
        else:
            self._by_call.discard(header.key.step)  # the SDK's own step of that number
        try:
            stage = shard.stage_for(header.key.deployment_id)
            _check_forward(header, x)
            incoming = await self._incoming_residuals(stage, header.key)
            await shard.order.after_optimizer_step(max(header.after_optimizer_step, after_verdict),
                                                   shard.settings.timeouts.peer_wait)
            if header.zero_grad:
                await shard.run(stage.zero_grad)
            started = time.perf_counter()
            result, outgoing = await shard.run(stage.forward, (header.key.step, header.key.microbatch), x, incoming,
                                               header.requires_grad, header.input_requires_grad, not header.eval_mode)
            if header.requires_grad and not header.eval_mode:
                shard.steps.forward(x, time.perf_counter() - started)
            self._forwarded = max(self._forwarded, header.key.step)
            if self._runtime.plan.next_address:
                # The activation first: the next stage needs it now, a residual's consumer only later.
                await self._send_activation(header, result)
                await self._send_residuals(header.key, outgoing)
            else:  # the SDK takes the output as the step's end: the model's other outputs go ahead of it
                await self._send_residuals(header.key, outgoing)
                await self._send_activation(header, result)
        except Exception as error:  # noqa: BLE001 - reported to the SDK, which waits for this step
            await self._report(header.key, error, backward=False)
            return error
        return None

    async def _send_activation(self, header: shard_pb2.ForwardHeader, result: torch.Tensor) -> None:
        """To the next stage, or (from the last stage) to the SDK as the output."""
        if self._runtime.plan.next_address:
            await self._send(self._down(), shard_pb2.LinkMessage(forward=header), result)
            return
        if self._down(header.key.step) is None:
            await self._sdk_output()
        await self._send(self._down(header.key.step), shard_pb2.LinkMessage(output=shard_pb2.TensorKey(key=header.key)),
                         result)

    async def _send_residuals(self, key: shard_pb2.StepKey, outgoing: dict[str, torch.Tensor],
                              to_client: bool = True) -> None:
        """Each residual this stage produced, straight to every stage that consumes it, and with `to_client` the
        model's other outputs to the SDK (a planned step returns only its loss)."""
        for name, tensor in outgoing.items():
            sink = next(r for r in self._runtime.plan.outgoing_residuals if r.name == name)
            for consumer, address in zip(sink.consumer_stages, sink.consumer_addresses):
                item = shard_pb2.LinkMessage(residual=shard_pb2.TensorKey(key=key, name=name))
                if consumer != CLIENT:
                    await self._send(self._client(address, _ROLES.LINK_ROLE_RESIDUAL), item, tensor, "residuals")
                elif to_client and key.step not in self._by_call:  # per-call RPCs carry no output after the first
                    if self._down(key.step) is None:
                        await self._sdk_output()
                    await self._send(self._down(key.step), item, tensor, "activations")

    async def _no_client_gradients(self, stage, key: shard_pb2.StepKey) -> None:
        """In a planned step the SDK sends no gradient for the model's outputs (the loss is taken on the last
        stage): each output's share from the SDK counts as none."""
        for name, consumers in stage.residuals.outgoing.items():
            if CLIENT in consumers:
                await self._runtime.accumulate(key, name, None)

    async def _sdk_output(self) -> None:
        """Waits (up to the peer-wait deadline) for the SDK's output link, opened at the same time as the input."""
        timeout = self._runtime.settings.timeouts.peer_wait
        try:
            await asyncio.wait_for(self._output_opened.wait(), timeout)
        except TimeoutError:
            raise errors.DeadlineExceeded(f"the SDK did not open its output link within {timeout:g} s") from None

    async def _incoming_residuals(self, stage, key: shard_pb2.StepKey) -> dict:
        shard = self._runtime
        incoming = {}
        for name in stage.residuals.incoming:
            producer = shard.producer(name).producer_stage
            source = "the SDK" if producer == CLIENT else f"stage {producer}"
            what = f"residual {name!r} of step {key.step} micro-batch {key.microbatch} from {source}"
            tensor = await self._residuals.get((key.step, key.microbatch, name), shard.settings.timeouts.peer_wait,
                                               what)
            self._residuals.discard((key.step, key.microbatch, name))
            spec = stage.incoming_spec(name)
            if spec is not None:
                spec.check(tensor, f"residual {name!r} from {source}")
            if key.step in self._by_call:  # a client of the per-call RPCs may fetch it (FetchTensor)
                self.calls.keep(key, name, tensor)
            incoming[name] = tensor
        return incoming

    async def _backward(self, header: shard_pb2.BackwardHeader, grad: torch.Tensor | None) -> BaseException | None:
        """Runs the stage's backward once the gradients of the residuals it produced are in, then sends the input
        gradient and the residuals' gradients back. Returns the failure it reported, if any."""
        shard = self._runtime
        key = (header.key.step, header.key.microbatch)
        try:
            stage = shard.stage_for(header.key.deployment_id)
            if header.zero_grad:
                await shard.run(stage.zero_grad)
            residual_grads = await shard.residual_gradients(stage, key)
            grad_input, incoming_grads = await shard.run(stage.backward, key, grad, residual_grads)
            # The input gradient first, as a forward sends its activation first: the previous stage's backward
            # needs it now, while a residual's producer is that stage or one before it, whose backward comes later.
            await self._send_input_gradient(header, grad_input)
            await self._send_residual_gradients(header.key, incoming_grads)
        except Exception as error:  # noqa: BLE001 - reported to the SDK; no stage will step on it
            await self._report(header.key, error, backward=True)
            await shard.order.backward_finished(key[0], status_message(error, shard.location)[1])
            return error
        await shard.order.backward_finished(key[0], "")
        return None

    async def _send_residual_gradients(self, key: shard_pb2.StepKey, grads: dict[str, torch.Tensor]) -> None:
        """The gradient of each residual this stage consumed, straight back to the stage that produced it."""
        for name, grad in grads.items():
            producer = self._runtime.producer(name).producer_stage
            if producer == CLIENT:
                continue  # a model input: it takes no gradient
            item = shard_pb2.LinkMessage(residual_gradient=shard_pb2.TensorKey(key=key, name=name))
            await self._send(self._from_stage.get(producer), item, grad, "residuals")

    async def _send_input_gradient(self, header: shard_pb2.BackwardHeader, grad_input: torch.Tensor | None) -> None:
        """To the previous stage (which clears its gradients first when this one did), or (from the first stage) to
        the SDK as the end of the backward."""
        key = header.key
        if self._runtime.plan.stage > 0:
            item = shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=key, zero_grad=header.zero_grad))
        elif grad_input is None and key.step in self._ended_by_step:
            self._ended_by_step.discard(key.step)
            return  # the optimizer step that lists it tells the SDK
        else:
            item = shard_pb2.LinkMessage(backward_done=shard_pb2.TensorKey(key=key))
        await self._send(self._up(key.step), item, grad_input, "gradients")

    async def _step(self, item: shard_pb2.LinkStep) -> str:
        """Passes an optimizer step on once this stage's share of its backwards is over, then applies it
        unless one of them failed here or on a stage before; returns why it was refused ("" if it was not).
        The step keeps its deployment's StepOrder: a LoadStage puts in a new one, then ends this step mid-way."""
        request, order = item.request, self._runtime.order
        stage, failure = await self._step_verdict(request, item.failure, order)
        if self._runtime.plan.next_address:
            verdict = shard_pb2.LinkMessage(step=shard_pb2.LinkStep(request=request, failure=failure))
            self._verdicts.passed_down(verdict)
            await self._pass_down(verdict)
        await self._apply_step(stage, request, failure, order)
        return failure

    async def _step_verdict(self, request: shard_pb2.StepRequest, failure: str,
                            order: StepOrder) -> tuple[Stage | None, str]:
        """Once this stage's backwards of the step are over: the stage, and why the step is refused ("" if it is
        not; a reason from a stage before wins)."""
        shard = self._runtime
        try:
            stage = shard.stage_for(request.deployment_id)
            failures = await order.backward_failures(request.backward_steps, shard.settings.timeouts.peer_wait)
        except Exception as error:  # noqa: BLE001 - the step is refused on this stage and those after it
            return None, failure or status_message(error, shard.location)[1]
        if failures and not failure:
            step, reason = next(iter(failures.items()))
            failure = f"the backward of step {step} failed: {reason}"
        return stage, failure

    async def _apply_step(self, stage: Stage | None, request: shard_pb2.StepRequest, failure: str,
                          order: StepOrder) -> None:
        """Applies the step unless it was refused; either way it counts as settled in `order` (its deployment's),
        and the step's state goes. Settled in a later deployment's order, it would let that deployment's forwards
        run before their own optimizer steps of the same numbers."""
        shard = self._runtime
        try:
            if stage is not None and request.hyperparameters_json:  # in force from this step on, applied or not
                await shard.run(stage.set_hyperparameters, request.hyperparameters_json)
            if stage is not None and not failure:
                if request.zero_grad:
                    await shard.run(stage.zero_grad)
                await self._sum_tied(stage, request.optimizer_step)
                started = time.perf_counter()
                await shard.run(stage.step, request.gradient_scale, request.optimizer_step, request.skip,
                                request.gradient_edits)
                self._record_stats(request, time.perf_counter() - started)
                shard.steps.stepped()
            else:
                shard.steps.clear()
        except Exception as error:  # noqa: BLE001 - this stage's optimizer failed: the SDK hears of it
            await self._tell(link.error_item(None, error, shard.location, optimizer_step=request.optimizer_step),
                             up=False)
        finally:
            await order.optimizer_step_settled(request.optimizer_step)
            if stage is not None:
                await shard.forget(stage, request.step)

    async def _sum_tied(self, stage: Stage, optimizer_step: int) -> None:
        """Before optimizer step `optimizer_step`: sends this stage's gradient of each weight it shares with other
        stages to them, and replaces its own with the sum over all of them in stage order (the same bits on every
        stage, so the copies stay equal). Once per optimizer step (clip_grad_norm_ may have done it)."""
        plan = self._runtime.plan
        if not plan.tied or optimizer_step in self._tied_summed:
            return
        self._tied_summed = {number for number in self._tied_summed if number > optimizer_step - VERDICTS_KEPT}
        self._tied_summed.add(optimizer_step)
        for tie in plan.tied:
            item = shard_pb2.LinkMessage(tied_gradient=shard_pb2.TiedGradient(
                optimizer_step=optimizer_step, key=tie.key, from_stage=plan.stage))
            for other, address in zip(tie.stages, tie.addresses):
                if other != plan.stage:
                    # To a later stage as a residual link (it may carry the next stage's items too), to an earlier
                    # one on a link of its own.
                    role = _ROLES.LINK_ROLE_RESIDUAL if other > plan.stage else _ROLES.LINK_ROLE_TIED
                    await self._send(self._client(address, role), item, stage.tied_gradient(tie.key), "exact")
        for tie in plan.tied:
            grads = []
            for other in tie.stages:
                if other == plan.stage:
                    grads.append(stage.tied_gradient(tie.key))
                    continue
                slot = (optimizer_step, tie.key, other)
                what = f"stage {other}'s gradient of tied weight {tie.key!r} for optimizer step {optimizer_step}"
                grads.append(await self._tied.get(slot, self._runtime.settings.timeouts.peer_wait, what))
                self._tied.discard(slot)
            total = summed([grad.to(stage.device) if grad is not None else None for grad in grads])
            await self._runtime.run(stage.set_tied_gradient, tie.key, total)

    def _record_stats(self, request: shard_pb2.StepRequest, optimizer_seconds: float) -> None:
        """Keeps what the planned step this optimizer step ends did here, for a Flush that asks."""
        run = self._runs.get(request.step)
        if run is None or not run.done:
            return
        plan = self._runtime.plan
        self._stats[request.optimizer_step] = run.figures.stats(plan.stage, plan.replica, optimizer_seconds)
        while len(self._stats) > STATS_KEPT:
            del self._stats[min(self._stats)]

    async def _flush(self, flush: shard_pb2.Flush) -> None:
        """Passes a Flush on (the last stage: back to the SDK) once its optimizer step settled here, with this
        stage's figures if it asks for them."""
        try:
            await self._runtime.order.after_optimizer_step(flush.optimizer_step,
                                                           self._runtime.settings.timeouts.peer_wait)
        except errors.ShardtrainError as error:
            await self._tell(link.error_item(None, error, self._runtime.location, optimizer_step=flush.optimizer_step),
                             up=False)
            return
        if flush.stats and flush.optimizer_step in self._stats:
            flush.stage_stats.append(self._stats[flush.optimizer_step])
        await self._pass_down(shard_pb2.LinkMessage(flush=flush))

    async def _pass_down(self, item: shard_pb2.LinkMessage) -> None:
        try:
            await self._send(self._down(), item)
        except errors.ShardtrainError as error:
            log.warning("%s: could not pass on a %s item: %s", self._runtime.location, item.WhichOneof("item"), error,
                        extra=self._runtime.fields())

    async def _pass_error(self, end: link.LinkEnd, message: shard_pb2.LinkMessage) -> None:
        """Passes a failure on the way it travels. A failed backward coming up counts as failed here, and so does
        a failed forward coming down: this stage will run no backward for that step (a planned step's optimizer
        step waits for one, even where no item of the step ever arrived)."""
        error = message.error
        from_below = not end.toward_first
        aborted = error.HasField("key") and self._abort_run(error.key.step, error.message)
        last_stage = not self._runtime.plan.next_address
        if error.HasField("key") and not from_below and last_stage and self._output is None:
            # A forward that failed before it reached the last stage, with no SDK here to hear of it: a client of
            # the per-call RPCs started it, and fetches its output from here.
            self._by_call.add(error.key.step)
        if error.HasField("key") and from_below:
            self._after_run(error.key.step, error.message)
        if error.HasField("key") and error.backward == from_below and not aborted:
            await self._runtime.order.backward_finished(error.key.step, error.message)
        await self._tell(message, up=from_below, either_way=False)

    def forget(self, up_to_step: int) -> None:
        """Drops the residuals of steps up to `up_to_step` that no forward took."""
        self._residuals.discard_where(lambda key: key[0] <= up_to_step)
        self._targets.discard_where(lambda key: key[0] <= up_to_step)
        # Recounted: a target sent twice replaced the first in the mailbox, and was counted twice.
        self._target_bytes = sum(tensor_bytes(target) for _, target in self._targets.delivered())
        for step in [step for step in self._after_runs if step <= up_to_step]:
            del self._after_runs[step]
        for step in [step for step in self._runs if step <= up_to_step]:
            run = self._runs.pop(step)
            run.abort()
            if run.task is not None:
                run.task.cancel()
        self._ended_by_step = {step for step in self._ended_by_step if step > up_to_step}
        self._by_call = {step for step in self._by_call if step > up_to_step}
        self._unread = {step for step in self._unread if step > up_to_step}
        self.calls.forget(up_to_step)

    async def close(self) -> None:
        """Ends the links this stage opened and the work in progress."""
        await self.reset("")


class _Verdicts:
    """The optimizer steps whose verdict (step item) a stage took, so that one sent again is taken once, and the
    last verdicts it passed down, to send again over a new link to the next stage.

    Why: a verdict lost with a broken link left the step applied on the stages before the break and on none
    after it, for good. Sent again, the stages after apply it (or refuse it) as they would have."""

    def __init__(self) -> None:
        self.last = 0                      # the highest optimizer step whose verdict came
        self._taken: set[int] = set()      # recent optimizer steps whose verdict came
        self._taken_up_to = 0              # and every one up to this
        self._passed: collections.deque[shard_pb2.LinkMessage] = collections.deque(maxlen=VERDICTS_KEPT)

    def take(self, number: int) -> bool:
        """Records that optimizer step `number`'s verdict came; False if it had come before."""
        if number <= self._taken_up_to or number in self._taken:
            return False
        self._taken.add(number)
        self.last = max(self.last, number)
        if len(self._taken) > 4 * VERDICTS_KEPT:
            oldest = min(self._taken)
            self._taken.discard(oldest)
            self._taken_up_to = oldest
        return True

    def passed_down(self, verdict: shard_pb2.LinkMessage) -> None:
        """Keeps a verdict passed to the next stage (the last VERDICTS_KEPT)."""
        self._passed.append(verdict)

    @property
    def passed(self) -> list[shard_pb2.LinkMessage]:
        """The last verdicts passed down, oldest first."""
        return list(self._passed)
