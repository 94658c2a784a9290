"""The SDK's two Links of a deployment: into the first stage (inputs, optimizer steps) and into the last
(output gradients). Outputs, finished backwards, flushes and failures come back on them and resolve
the futures the loop waits on. See shardtrain/link_streams.py for why streams and not calls.

An optimizer step is settled on every stage once an output comes back whose forward was sent after
it (every stage waits for the step before running a later forward), or once a Flush comes back.
The backwards a step lists are over by then too (a stage steps only after them), so the first stage
sends no backward_done for one that ends after the step reached it: in the PyTorch-shaped loop, where
model.step() follows loss.backward() at once, that is every backward. The item woke this process
while the first stage went on to its optimizer step, on the same core as a rule (bench/host.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import torch

from shardtrain import errors, link_streams, wire
from shardtrain.rpc import Peer
from shardtrain.v1 import shard_pb2
from shardtrain.waiting import settled_within

_ROLES = shard_pb2.LinkRole


class SdkLinks:
    """Sends the loop's items and matches what comes back to the step (or optimizer step) that waits for it."""

    def __init__(self, deployment_id: str, first: Peer, last: Peer,
                 options: Callable[[Peer, str], wire.SendOptions], timeout: float,
                 diagnose: Callable[[], Awaitable[str]] | None = None):
        self._deployment_id = deployment_id
        self._first, self._last = first, last
        self._options = options
        self._timeout = timeout
        self._diagnose = diagnose or _nothing  # what a wait that ran out adds to its message: the silent stages
        self._links: dict[int, link_streams.ClientLink] = {}
        self._outputs: dict[int, asyncio.Future] = {}    # step -> (the model's output, its other outputs by name)
        self._extras: dict[int, dict] = {}               # step -> the other outputs come so far, ahead of the output
        self._backwards: dict[int, asyncio.Future] = {}  # step -> the input's gradient (or None) once done
        self._settles: dict[int, asyncio.Future] = {}    # optimizer step -> None once settled everywhere
        self._follows: dict[int, int] = {}               # forward step -> the optimizer step it follows
        self._ends_with: dict[int, list[int]] = {}       # optimizer step -> the backwards it ends
        self._after_forward: dict[int, int] = {}         # optimizer step -> the last forward step sent before it
        self._flushed = 0                                # the highest optimizer step a Flush was sent for
        self._losses: dict[int, asyncio.Future] = {}     # planned step -> its loss, once every micro-batch's came
        self._loss_parts: dict[int, list] = {}           # planned step -> [loss so far, micro-batches still to come]
        self._planned: dict[int, asyncio.Future] = {}    # planned step -> fails if the step fails anywhere
        self._stats: dict[int, list] = {}                # optimizer step -> the StageStats its Flush brought back
        self._later: set[asyncio.Task] = set()           # optimizer steps sent once their gradient scale is known

    def _link(self, role: int) -> link_streams.ClientLink:
        client = self._links.get(role)
        if client is None or client.broken is not None:
            peer = self._first if role == _ROLES.LINK_ROLE_INPUT else self._last
            opening = shard_pb2.LinkOpen(deployment_id=self._deployment_id, role=role, from_stage=-1,
                                         shared_memory=peer.same_host, local_carrier=peer.same_host,
                                         tcp_carrier=not peer.same_host)  # TLS when the channel is
            client = link_streams.ClientLink(peer, opening, self._on_item, self._broke)
            self._links[role] = client
        return client

    async def _send(self, role: int, message: shard_pb2.LinkMessage, tensor: torch.Tensor | None = None,
                    kind: str = "activations") -> None:
        client = self._link(role)
        await client.send(message, tensor, self._options(client.peer, kind))

    async def _wait(self, pending: dict, key: int, future: asyncio.Future, what: str):
        try:
            if not await settled_within(future, self._timeout):
                why = await self._diagnose()
                raise errors.DeadlineExceeded(f"{what} did not arrive within {self._timeout:g} s{why}")
            return future.result()
        finally:
            if pending.get(key) is future:
                del pending[key]

    async def forward(self, header: shard_pb2.ForwardHeader, x: torch.Tensor,
                      inputs: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sends x into the first stage, the model's other inputs ahead of it as residuals; returns the last stage's
        output and the model's other outputs, which come ahead of it."""
        step = header.key.step
        future = _expect(self._outputs, step)
        self._follows[step] = header.after_optimizer_step
        try:
            self._link(_ROLES.LINK_ROLE_OUTPUT)  # opened now: the last stage sends the output on it
            await self._send_inputs(header.key, inputs or {})
            await self._send(_ROLES.LINK_ROLE_INPUT, shard_pb2.LinkMessage(forward=header), x)
        except BaseException:
            self._outputs.pop(step, None)
            self._follows.pop(step, None)
            raise
        try:
            return await self._wait(self._outputs, step, future, f"the output of step {step} from {self._last.name}")
        finally:
            self._follows.pop(step, None)
            self._extras.pop(step, None)

    async def _send_inputs(self, key: shard_pb2.StepKey,
                           inputs: dict[str, torch.Tensor | shard_pb2.DataRows]) -> None:
        """The model's inputs after the first, as residuals the SDK produces, ahead of the forward that reads them
        (DataRows: rows the first stage reads itself)."""
        for name, value in inputs.items():
            rows = value if isinstance(value, shard_pb2.DataRows) else None
            item = shard_pb2.LinkMessage(residual=shard_pb2.TensorKey(key=key, name=name, data=rows))
            await self._send(_ROLES.LINK_ROLE_INPUT, item, None if rows else value, "residuals")

    async def backward(self, header: shard_pb2.BackwardHeader, grad: torch.Tensor | None,
                       output_grads: dict[str, torch.Tensor | None] | None = None) -> torch.Tensor | None:
        """Sends the outputs' gradients into the last stage (the other outputs' ahead of the main one's; None for
        one without); returns (the input's gradient or None) once every stage has run backward."""
        step = header.key.step
        future = _expect(self._backwards, step)
        for name, output_grad in (output_grads or {}).items():
            item = shard_pb2.LinkMessage(residual_gradient=shard_pb2.TensorKey(key=header.key, name=name))
            await self._send(_ROLES.LINK_ROLE_OUTPUT, item, output_grad, "gradients")
        await self._send(_ROLES.LINK_ROLE_OUTPUT, shard_pb2.LinkMessage(backward=header), grad, "gradients")
        return await self._wait(self._backwards, step, future,
                                f"the end of step {step}'s backward on {self._first.name}")

    async def planned(self, forwards: list[tuple[shard_pb2.ForwardHeader, torch.Tensor, dict[str, torch.Tensor]]],
                      targets: list[tuple[shard_pb2.LossTarget, torch.Tensor | None]],
                      request: shard_pb2.StepRequest,
                      gradient_scale: asyncio.Future | None = None) -> tuple[float, asyncio.Future]:
        """A planned step: the micro-batches (the model's other inputs ahead of each) into the first stage, their
        targets (none where the model computes its loss) into the last, then the optimizer
        step and a Flush asking for every stage's figures. Returns the step's loss as soon as the last stage sent
        it, with a future that ends (with the stages' StageStats) once every stage settled the step, or fails with
        the step's failure: the backwards and the optimizer step go on meanwhile, as after the loop's step().
        With `gradient_scale` (clipping, loss scaling), the optimizer step goes once that future has the scale
        and whether to skip the step."""
        step, number = forwards[0][0].key.step, request.optimizer_step
        loss = _expect(self._losses, step)
        failed = _expect(self._planned, step)
        self._loss_parts[step] = [0.0, len(forwards)]
        settled = _expect(self._settles, number)
        self._after_forward[number] = step
        self._flushed = max(self._flushed, number)
        self._link(_ROLES.LINK_ROLE_OUTPUT)  # opened now: the last stage sends the losses on it

        async def send_targets() -> None:
            for target, y in targets:
                await self._send(_ROLES.LINK_ROLE_OUTPUT, shard_pb2.LinkMessage(target=target), y)

        async def send_step() -> None:
            if gradient_scale is not None:
                request.gradient_scale, request.skip = await gradient_scale
            await self._send(_ROLES.LINK_ROLE_INPUT, shard_pb2.LinkMessage(step=shard_pb2.LinkStep(request=request)))
            flush = shard_pb2.Flush(optimizer_step=number, stats=True)
            await self._send(_ROLES.LINK_ROLE_INPUT, shard_pb2.LinkMessage(flush=flush))

        async def send_inputs() -> None:
            for header, x, inputs in forwards:
                await self._send_inputs(header.key, inputs)
                await self._send(_ROLES.LINK_ROLE_INPUT, shard_pb2.LinkMessage(forward=header), x)
            if gradient_scale is None:
                await send_step()
            else:  # after the backwards: the loss comes back before then
                self._send_later(send_step(), settled)
        try:
            await asyncio.gather(send_targets(), send_inputs())
            value = await self._wait(self._losses, step, loss, f"the loss of step {step} from {self._last.name}")
        except BaseException:
            self._planned.pop(step, None)
            raise
        finally:
            self._loss_parts.pop(step, None)
        outcome = asyncio.ensure_future(self._planned_outcome(step, number, settled, failed))
        # Seen, even if nobody awaits it: a step that failed on another replica, or a replaced deployment's.
        outcome.add_done_callback(lambda done: done.cancelled() or done.exception())
        return value, outcome

    def _send_later(self, sending, settled: asyncio.Future) -> None:
        """Sends in a task of its own; if that fails, the step it was for fails with it."""
        task = asyncio.ensure_future(sending)
        self._later.add(task)

        def done(task: asyncio.Task) -> None:
            self._later.discard(task)
            if not task.cancelled() and task.exception() is not None and not settled.done():
                settled.set_exception(task.exception())
        task.add_done_callback(done)

    async def _planned_outcome(self, step: int, number: int, settled: asyncio.Future, failed: asyncio.Future) -> list:
        """The StageStats of a planned step once every stage settled it; its failure if it failed anywhere (a
        failure's error items travel ahead of the step's verdict on every link, so they arrive first)."""
        try:
            await asyncio.shield(settled)  # no deadline here: flush() sets one when someone must know
            if failed.done():
                failed.result()
            return self._stats.pop(number, [])
        finally:
            self._planned.pop(step, None)
            self._stats.pop(number, None)

    def step(self, request: shard_pb2.StepRequest) -> asyncio.Future:
        """Sends an optimizer step down the stages. The future ends once every stage settled it (with an error
        if a stage's optimizer failed); nothing answers a step by itself: a later output or flush() does."""
        number = request.optimizer_step
        settled = _expect(self._settles, number)  # now, so that a flush() right after knows of it
        self._after_forward[number] = request.step
        if request.backwards_end_with_step:
            self._ends_with[number] = list(request.backward_steps)
        sent = asyncio.ensure_future(self._send(_ROLES.LINK_ROLE_INPUT,
                                                shard_pb2.LinkMessage(step=shard_pb2.LinkStep(request=request))))
        return asyncio.ensure_future(self._step_settled(number, sent, settled))

    async def _step_settled(self, number: int, sent: asyncio.Future, settled: asyncio.Future) -> None:
        try:
            await sent
            await asyncio.shield(settled)  # no deadline here: flush() sets one when someone must know
        finally:
            if self._settles.get(number) is settled:
                del self._settles[number]
            self._after_forward.pop(number, None)

    async def flush(self, wait: bool = True) -> None:
        """Asks every stage to confirm the optimizer steps sent so far, unless a later output already did;
        with `wait`, waits (up to the deadline) until they have."""
        pending = [number for number, future in self._settles.items() if not future.done()]
        if not pending:
            return
        number = max(pending)
        if number > self._flushed:
            self._flushed = number
            flush = shard_pb2.Flush(optimizer_step=number)
            await self._send(_ROLES.LINK_ROLE_INPUT, shard_pb2.LinkMessage(flush=flush))
        if not wait:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*(asyncio.shield(self._settles[n]) for n in pending
                                                    if n in self._settles), return_exceptions=True), self._timeout)
        except TimeoutError:
            why = await self._diagnose()
            raise errors.DeadlineExceeded(f"optimizer step {number} was not confirmed by every stage within "
                                          f"{self._timeout:g} s{why}") from None

    def _settled(self, up_to: int) -> None:
        for number in [n for n in self._settles if n <= up_to]:
            _resolve(self._settles.pop(number), None)
            self._after_forward.pop(number, None)
            self._end_backwards(number, None)

    def _end_backwards(self, number: int, error: BaseException | None) -> None:
        """The backwards optimizer step `number` ends: done once it settled (a failed one failed before)."""
        for step in self._ends_with.pop(number, ()):
            _resolve(self._backwards.get(step), None, error)

    # --- what comes back ------------------------------------------------------------------------------
    def _on_item(self, end: link_streams.LinkEnd, message: shard_pb2.LinkMessage, tensor: torch.Tensor | None) -> None:
        kind = message.WhichOneof("item")
        if kind == "output":
            step = message.output.key.step
            self._settled(self._follows.get(step, 0))
            _resolve(self._outputs.get(step), (tensor, self._extras.pop(step, {})))
        elif kind == "residual":  # one of the model's other outputs
            if message.residual.key.step in self._outputs:
                self._extras.setdefault(message.residual.key.step, {})[message.residual.name] = tensor
        elif kind == "backward_done":
            _resolve(self._backwards.get(message.backward_done.key.step), tensor)
        elif kind == "loss":
            self._add_loss(message.loss)
        elif kind == "flush":
            if message.flush.stats and message.flush.optimizer_step in self._settles:
                self._stats[message.flush.optimizer_step] = list(message.flush.stage_stats)
            self._settled(message.flush.optimizer_step)
        elif kind == "error":
            self._failed(message.error)

    def _add_loss(self, loss: shard_pb2.StepLoss) -> None:
        parts = self._loss_parts.get(loss.key.step)
        if parts is None:
            return  # a step that already failed
        parts[0] += loss.loss
        parts[1] -= 1
        if parts[1] == 0:
            _resolve(self._losses.get(loss.key.step), parts[0])

    def _failed(self, error: shard_pb2.LinkError) -> None:
        exception = link_streams.raised(error)
        if error.optimizer_step:
            _resolve(self._settles.pop(error.optimizer_step, None), None, exception)
            self._end_backwards(error.optimizer_step, exception)
            return
        if not error.HasField("key"):
            self._link_broke(exception, error.through_step if error.HasField("through_step") else None)
            return
        step = error.key.step
        for pending in (self._losses, self._planned):  # a planned step fails whichever way its error came
            _resolve(pending.get(step), None, exception)
        first, second = (self._backwards, self._outputs) if error.backward else (self._outputs, self._backwards)
        _resolve(first.get(step), None, exception)
        if not error.backward:
            _resolve(second.get(step), None, exception)  # a step whose forward failed has no backward

    def _link_broke(self, exception: errors.ShardtrainError, through_step: int | None) -> None:
        """Fails what a broken link may have cost: the steps through `through_step` and the optimizer steps sent after
        no later forward, or everything in flight (None). A stage's report may be read only after the failure it
        caused ended the user's iteration and the next one began: that one went out later and stays."""
        def lost(step: int) -> bool:
            return through_step is None or step <= through_step
        for pending in (self._outputs, self._backwards, self._losses, self._planned):
            for step, future in pending.items():
                if lost(step):
                    _resolve(future, None, exception)
        for number, future in list(self._settles.items()):
            if lost(self._after_forward.get(number, -1)):
                _resolve(future, None, exception)
                self._end_backwards(number, exception)

    def _broke(self, client: link_streams.ClientLink, error: errors.ShardtrainError) -> None:
        self._failed(shard_pb2.LinkError(code=error.code, message=str(error)))

    async def close(self) -> None:
        """Ends both links; the shards keep the model."""
        for task in list(self._later):
            task.cancel()
        links, self._links = self._links, {}
        for client in links.values():
            await client.close()
        self._link_broke(errors.FailedPrecondition(f"deployment {self._deployment_id}: the client closed"), None)
        self._ends_with.clear()


def _expect(pending: dict, key: int) -> asyncio.Future:
    """A new future that `pending` holds under `key`, for what comes back to resolve."""
    future = asyncio.get_running_loop().create_future()
    pending[key] = future
    return future


def _resolve(future: asyncio.Future | None, value, error: BaseException | None = None) -> None:
    if future is None or future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
        future.exception()  # retrieved: the step may be waited on by nobody


async def _nothing() -> str:
    return ""
