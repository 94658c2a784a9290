"""ShardService over gRPC: decodes requests and hands them to the shard's runtime (runtime.py) and Link loop
(loop.py). The per-call Forward and Backward RPCs keep their own small state: outputs and residuals waiting to
be fetched, and Backward calls opened at forward time."""

from __future__ import annotations

import asyncio
import os

from shard_service.loop import LinkedLoop
from shard_service.mailbox import Mailbox
from shard_service.runtime import ShardRuntime
from shard_service.stage import Stage
from shardtrain import auth, carrier, link, optim, shm, wire
from shardtrain.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from shardtrain.residuals import INPUT_GRADIENT, OUTPUT
from shardtrain.rpc import OpenedCalls, boundary
from shardtrain.settings import ShardSettings
from shardtrain.streams import RequestReader
from shardtrain.v1 import shard_pb2

_FETCHED_KINDS = {OUTPUT: "activations", INPUT_GRADIENT: "gradients"}  # any other name is a residual
_STAGE_LINKS = (shard_pb2.LINK_ROLE_NEXT, shard_pb2.LINK_ROLE_RESIDUAL)  # opened by stages; the rest by the SDK


def _listener(settings: ShardSettings, address: str) -> carrier.Listener | None:
    """A Unix socket for openers on this host, a TCP one for openers on others (not under TLS: the socket would
    carry tensors in clear)."""
    tls = bool(settings.security.tls_cert or settings.security.tls_ca)
    tcp = settings.tcp_links and not tls
    if not (settings.local_links or tcp):
        return None
    bind_host = settings.bind.rpartition(":")[0].strip("[]")
    return carrier.Listener(unix=settings.local_links, tcp_bind=bind_host if tcp else "",
                            tcp_advertise=address.rpartition(":")[0].strip("[]"))


class ShardServicer:
    """The gRPC face of one shard."""

    def __init__(self, settings: ShardSettings, address: str):
        self.settings = settings
        self.address = address
        self.runtime = ShardRuntime(settings, address)
        self.loop = LinkedLoop(self.runtime)  # the Link items: the PyTorch-shaped loop and planned steps
        self.local_links = _listener(settings, address)  # sockets that carry Link items instead of gRPC streams
        self._outbox = Mailbox()        # residuals and the output of Forward calls, waiting to be fetched
        self._backward_links = OpenedCalls(settings.max_in_flight)  # Backward calls opened at forward time
        self.runtime.forgetters.append(self._forget)
        self.health = None  # the server's grpc.health.v1 status (set by build_server)

    @property
    def location(self) -> str:
        """How errors name this shard."""
        return self.runtime.location

    def _owned(self, context, deployment_id: str) -> Stage:
        """The stage, for a call on its deployment that carries the deployment's secret."""
        stage = self.runtime.stage_for(deployment_id)
        auth.check_deployment(context, self.runtime.secret, f"deployment {deployment_id}")
        return stage

    def _forget(self, up_to_step: int) -> None:
        stale = lambda key: key[0] <= up_to_step  # noqa: E731 - a one-line predicate
        self._outbox.discard_where(stale)
        self._backward_links.abandon_where(stale)

    @boundary
    async def LoadStage(self, request, context):
        response = await self.runtime.load(request)
        await self.loop.reset(request.deployment_id)
        self._outbox.discard_where(lambda key: True)
        self._backward_links.abandon_where(lambda key: True)
        return response

    @boundary
    async def LoadState(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        stage = self._owned(context, (await reader.header()).deployment_id)
        loaded = await self.runtime.run(stage.load_state, await reader.tensors())
        return shard_pb2.LoadStateResponse(loaded=loaded)

    @boundary
    async def ReadState(self, request, context):
        stage = self._owned(context, request.deployment_id)
        for name, tensor in (await self.runtime.run(stage.state)).items():
            for frame in wire.tensor_frames(tensor, name, wire.SendOptions(self.settings.chunk_bytes)):
                yield frame  # weights always travel exact

    @boundary
    async def ReadOptimizerState(self, request, context):
        stage = self._owned(context, request.deployment_id)
        state = await self.runtime.run(stage.optimizer_state)
        header = shard_pb2.OptimizerStateHeader(deployment_id=request.deployment_id, layout=state.layout())
        for frame in wire.framed(shard_pb2.OptimizerStateMessage, header, state.tensors,
                                 wire.SendOptions(self.settings.chunk_bytes)):
            yield frame  # exact, as weights

    @boundary
    async def LoadOptimizerState(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        stage = self._owned(context, header.deployment_id)
        state = optim.KeyedState.parse(header.layout, await reader.tensors())
        await self.runtime.run(stage.load_optimizer_state, state, header.check_only)
        return shard_pb2.LoadOptimizerStateResponse()

    @boundary
    async def Forward(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        stage = self._owned(context, header.key.deployment_id)
        if header.HasField("plan"):
            raise InvalidArgument("a planned step's forwards travel on Links, not on Forward calls")
        key = (header.key.step, header.key.microbatch)
        # The header goes on at once, so later stages fetch their residuals and apply a deferred optimizer
        # step while this one computes.
        downstream = self.runtime.peers.open_forward(header) if self.runtime.plan.next_address else None
        stepping = asyncio.ensure_future(self.apply_step(stage, header.step_first)) \
            if header.HasField("step_first") else None
        try:
            x, incoming = await self._inputs(stage, header.key, reader)
            if stepping is not None:
                await stepping
            await self.runtime.order.after_optimizer_step(header.after_optimizer_step, self.settings.timeouts.peer_wait)
            if header.zero_grad:
                await self.runtime.run(stage.zero_grad)
            result, outgoing = await self.runtime.run(stage.forward, key, x, incoming, header.requires_grad,
                                               header.input_requires_grad, not header.eval_mode)
            self.offer_residuals(stage, key, outgoing)
            if header.requires_grad and self.runtime.plan.previous_address:
                self._backward_links.add(key, self.runtime.peers.open_backward(header.key))
            if downstream is None:
                self._outbox.put((*key, OUTPUT), [result, 1])
            else:
                same_host = self.runtime.peers.peer(self.runtime.plan.next_address).same_host
                await downstream.send({"activation": result}, self.runtime.peers.options(same_host, "activations"))
        finally:
            if downstream is not None:
                downstream.abandon()  # a no-op once sent; otherwise later stages stop waiting
            if stepping is not None:
                # Never cancelled: every stage applies the step whatever becomes of this forward, or the
                # stages' weights would drift apart. Its own failure is reported through `await stepping`.
                stepping.add_done_callback(lambda task: task.cancelled() or task.exception())
        return shard_pb2.ForwardResponse()

    async def _inputs(self, stage: Stage, key, reader: RequestReader):
        """The activation from the stream and every incoming residual, fetched concurrently."""
        fetches = asyncio.ensure_future(self.fetch_residuals(stage, key))
        try:
            tensors = await reader.tensors(count=1)  # not waiting for the sender to close its side
            if len(tensors) != 1:
                raise InvalidArgument(f"Forward carries exactly one activation tensor, got {len(tensors)}")
            return next(iter(tensors.values())), await fetches
        finally:
            fetches.cancel()

    async def _fetch_residual(self, stage: Stage, key, name: str):
        tensor = await self.runtime.peers.fetch_residual(key, name)
        producer = self.runtime.peers.producer(name).producer_stage
        stage.incoming_spec(name).check(tensor, f"residual {name!r} from stage {producer}")
        return tensor

    @boundary
    async def FetchTensor(self, request, context):
        self._owned(context, request.key.deployment_id)
        key = (request.key.step, request.key.microbatch, request.name)
        what = f"tensor {request.name!r} of step {request.key.step} micro-batch {request.key.microbatch}"
        entry = await self._outbox.get(key, self.settings.timeouts.peer_wait, what)
        kind = _FETCHED_KINDS.get(request.name, "residuals")
        options = self.runtime.peers.options(request.shared_memory, kind)
        for frame in wire.tensor_frames(entry[0], request.name, options, start=request.offset):
            yield frame
        # Kept until a fetch got all of it, so a broken stream can resume; _forget drops the rest.
        entry[1] -= 1
        if entry[1] <= 0:
            self._outbox.discard(key)

    @boundary
    async def Backward(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.backward_link)  # opened at forward time
        header = await reader.header()
        stage = self._owned(context, header.key.deployment_id)
        failure = "cancelled"
        try:
            await self._backward(stage, header, reader)
            failure = ""
        except Exception as error:
            failure = str(error)
            raise
        finally:
            await self.runtime.order.backward_finished(header.key.step, failure)
        return shard_pb2.BackwardResponse()

    async def _backward(self, stage: Stage, header, reader: RequestReader) -> None:
        """This stage's backward, then (concurrently) the previous stage's and the residual producers'."""
        grad_output = (await reader.tensors()).get("gradient")
        key = (header.key.step, header.key.microbatch)
        if header.zero_grad:
            await self.runtime.run(stage.zero_grad)
        residual_grads = await self.runtime.residual_gradients(stage, key)
        grad_input, incoming_grads = await self.runtime.run(stage.backward, key, grad_output, residual_grads)
        calls = [self.runtime.peers.send_residual_grad(header.key, name, grad) for name, grad in incoming_grads.items()]
        if not self.runtime.plan.previous_address and grad_input is not None:
            self._outbox.put((*key, INPUT_GRADIENT), [grad_input, 1])
        if self.runtime.plan.previous_address:
            link = self._backward_links.pop(key)
            if link is not None and header.zero_grad:
                link.abandon()  # its header went out at forward time: the previous stage must clear its gradients too
                link = None
            link = link or self.runtime.peers.open_backward(header.key, header.zero_grad)
            same_host = self.runtime.peers.peer(self.runtime.plan.previous_address).same_host
            calls.append(link.send({"gradient": grad_input} if grad_input is not None else {},
                                   self.runtime.peers.options(same_host, "gradients")))
        await asyncio.gather(*calls)

    @boundary
    async def AccumulateGradient(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        self._owned(context, header.key.deployment_id)
        grad = (await reader.tensors()).get(header.name) if header.has_gradient else None
        await self.runtime.accumulate(header.key, header.name, grad)
        return shard_pb2.AccumulateGradientResponse()

    @boundary
    async def Step(self, request, context):
        await self.apply_step(self._owned(context, request.deployment_id), request)
        return shard_pb2.StepResponse()

    async def apply_step(self, stage: Stage, request) -> None:
        """Steps the optimizer once this stage's share of the listed backwards has succeeded."""
        try:
            failures = await self.runtime.order.backward_failures(request.backward_steps,
                                                                  self.settings.timeouts.peer_wait)
            if failures:
                step, reason = next(iter(failures.items()))
                raise FailedPrecondition(f"optimizer step {request.optimizer_step} not applied: the backward of "
                                         f"step {step} failed: {reason}")
            if request.zero_grad:
                await self.runtime.run(stage.zero_grad)
            await self.runtime.run(stage.step)
        finally:
            await self.runtime.order.optimizer_step_settled(request.optimizer_step)
            await self.runtime.forget(stage, request.step)

    @boundary
    async def Link(self, request_iterator, context):
        roles = auth.caller_roles(context, self.settings.security)

        def opened(opening: shard_pb2.LinkOpen, end: link.LinkEnd) -> None:
            needed = auth.SHARD if opening.role in _STAGE_LINKS else auth.CLIENT
            if needed not in roles:
                raise PermissionDenied(f"a {shard_pb2.LinkRole.Name(opening.role)} link takes the {needed} role's "
                                       f"token; this caller has the {' or '.join(sorted(roles))} role")
            self._owned(context, opening.deployment_id)
            self.loop.opened(opening, end)
        await link.serve(request_iterator, context, f"link to {self.runtime.location}", opened,
                         self.loop.on_item, self.loop.closed, self.local_links)

    async def fetch_residuals(self, stage: Stage, key: shard_pb2.StepKey) -> dict:
        """Every residual this stage consumes for a micro-batch, fetched from their producers at once."""
        names = list(stage.residuals.incoming)
        fetched = await asyncio.gather(*(self._fetch_residual(stage, key, name) for name in names))
        return dict(zip(names, fetched))

    def offer_residuals(self, stage: Stage, key, outgoing: dict) -> None:
        """Leaves a micro-batch's residuals for the stages that consume them."""
        for name, tensor in outgoing.items():
            self._outbox.put((*key, name), [tensor, len(stage.residuals.outgoing[name])])

    @boundary
    async def Describe(self, request, context):
        stage = self.runtime.stage
        return shard_pb2.DescribeResponse(
            address=self.address, device=self.settings.device, deployment_id=self.runtime.deployment_id,
            stage=stage.index if stage else -1, layer_indexes=stage.layer_indexes if stage else [],
            in_flight_steps=[key[0] for key in stage.in_flight_steps] if stage else [],
            parameter_count=stage.parameter_count if stage else 0, flush_denormal=self.settings.flush_denormal)

    @boundary
    async def ProbeSharedMemory(self, request, context):
        return shard_pb2.ProbeSharedMemoryResponse(token=shm.read_probe(request.path), uid=os.getuid())

    async def close(self) -> None:
        """Ends the links, closes peer channels, the compute thread and this shard's shared segments."""
        await self.loop.close()
        await self.runtime.close()
        if self.local_links is not None:
            await self.local_links.close()
