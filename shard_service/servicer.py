"""ShardService over gRPC: decodes requests, calls the Stage, pushes results to neighbouring shards."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from shard_service.links import Links
from shard_service.loop import LinkedLoop
from shard_service.mailbox import Mailbox
from shard_service.ordering import StepOrder
from shard_service.replicas import GradientAverager
from shard_service.stage import LayerSource, Stage
from shard_service.stage_plan import check_load
from shard_service.threads import ThreadChoice, work_kind
from shardtrain import auth, carrier, link, losses, optim, shm, wire
from shardtrain.capture import CapturedProgram
from shardtrain.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from shardtrain.residuals import INPUT_GRADIENT, OUTPUT, StageResiduals, Wiring
from shardtrain.rpc import OpenedCalls, boundary
from shardtrain.settings import ShardSettings
from shardtrain.streams import RequestReader
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.shard")
INLINE_SECONDS = 5e-3
_FETCHED_KINDS = {OUTPUT: "activations", INPUT_GRADIENT: "gradients"}  # any other name is a residual
_STAGE_LINKS = (shard_pb2.LINK_ROLE_NEXT, shard_pb2.LINK_ROLE_RESIDUAL)  # opened by stages; the rest by the SDK


def _with_threads(threads: int, function, *args):
    """Runs `function` with `threads` intra-op threads (a per-thread OpenMP setting: set where it runs);
    returns its result and how long it ran (there, not counting the hand-off to and from the compute thread)."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    return function(*args), time.perf_counter() - start


class ShardServicer:
    """The gRPC face of one shard; all model logic lives in Stage."""

    def __init__(self, settings: ShardSettings, address: str):
        self.settings = settings
        self.address = address
        self._deployment_id = ""
        self._stage: Stage | None = None
        self.links = Links(settings)
        self.loop = LinkedLoop(self)    # the PyTorch-shaped loop over Link streams
        self.local_links = carrier.Listener() if settings.local_links else None  # for same-host openers
        self._outbox = Mailbox()        # residuals and the output, waiting to be fetched
        self._gradients = Mailbox()     # residual gradients, waiting for this stage's backward
        self._averager: GradientAverager | None = None  # this stage's replicas, when data parallel
        self._losses: dict[bytes, tuple] = {}
        self._residual_grads: dict[tuple, list] = {}  # received so far, per (step, microbatch, name)
        self._backward_links = OpenedCalls(settings.max_in_flight)  # Backward calls opened at forward time
        self._order = StepOrder()
        self._stage_lock = asyncio.Lock()
        self._durations: dict[str, float] = {}
        self._threads = ThreadChoice(settings.threads or torch.get_num_threads())
        # One stage, one thread, in order. OpenMP thread counts are per thread, so _with_threads sets
        # the count where the work runs: set only in the main thread, the compute thread would start
        # a team per core and spin against the other shards on the same host.
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="stage")
        self.health = None  # the server's grpc.health.v1 status (set by build_server)

    @property
    def location(self) -> str:
        """How errors name this shard."""
        stage = f"stage {self._stage.index}" if self._stage else "no stage loaded"
        return f"shard {self.address} ({stage})"

    async def _run(self, function, *args):
        """Runs stage work one piece at a time, in arrival order.

        Work that took under INLINE_SECONDS last time runs on the event loop itself: handing it to
        the compute thread and back costs two thread wake-ups, which on a busy host take longer than
        small work itself. Longer work goes to the compute thread so the loop keeps reading streams
        (a planned step's next micro-batch) and serving deadlines meanwhile.
        """
        async with self._stage_lock:
            name = work_kind(function.__name__, args)
            threads = self._threads.threads(name)
            if self._durations.get(name, INLINE_SECONDS) < INLINE_SECONDS:
                result, elapsed = _with_threads(threads, function, *args)
            else:
                result, elapsed = await asyncio.get_running_loop().run_in_executor(
                    self._compute, _with_threads, threads, function, *args)
            self._durations[name] = elapsed
            self._threads.record(name, threads, elapsed)
            return result

    def stage_for(self, deployment_id: str) -> Stage:
        if self._stage is None:
            raise FailedPrecondition("no stage is loaded here; deploy a model first")
        if deployment_id != self._deployment_id:
            raise FailedPrecondition(f"this shard holds deployment {self._deployment_id!r}, "
                                     f"not {deployment_id!r}; the model was redeployed")
        return self._stage

    @boundary
    async def LoadStage(self, request, context):
        check_load(request)
        sources = [LayerSource(layer.index, layer.description, layer.program,
                               Wiring(tuple(layer.dependencies), tuple(layer.out_variables)),
                               {entry.graph_key: entry.model_key for entry in layer.state}, layer.eval_program)
                   for layer in request.layers]
        plan = request.plan
        residuals = StageResiduals({r.name: r.producer_stage for r in plan.incoming_residuals},
                                   {r.name: list(r.consumer_stages) for r in plan.outgoing_residuals})
        optimizer = (request.optimizer.name, request.optimizer.kwargs_json)
        stage = await self._run(Stage, plan.stage, sources, residuals, optimizer, self.settings.device,
                                self.settings.max_in_flight)
        await self.links.adopt(plan, request.encodings)
        self._stage, self._deployment_id = stage, request.deployment_id
        await self.loop.reset(request.deployment_id)
        self._outbox.discard_where(lambda key: True)
        self._gradients.discard_where(lambda key: True)
        self._losses.clear()  # built for the previous deployment's last stage
        if self._averager is not None:
            self._averager.close()
        # Off the event loop: joining a replica's rendezvous store blocks until it answers or times out.
        self._averager = await asyncio.to_thread(GradientAverager.for_plan, plan, stage, self.address,
                                                 self.settings.timeouts.peer_wait)
        self._order = StepOrder()
        self._backward_links.abandon_where(lambda key: True)
        log.info("loaded stage %d (layers %s) of deployment %s", plan.stage, stage.layer_indexes,
                 request.deployment_id)
        return shard_pb2.LoadStageResponse(parameter_count=stage.parameter_count,
                                           rendezvous=self._averager.hosted if self._averager else "")

    @boundary
    async def LoadState(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        stage = self.stage_for((await reader.header()).deployment_id)
        loaded = await self._run(stage.load_state, await reader.tensors())
        return shard_pb2.LoadStateResponse(loaded=loaded)

    @boundary
    async def ReadState(self, request, context):
        stage = self.stage_for(request.deployment_id)
        for name, tensor in (await self._run(stage.state)).items():
            for frame in wire.tensor_frames(tensor, name, wire.SendOptions(self.settings.chunk_bytes)):
                yield frame  # weights always travel exact

    @boundary
    async def ReadOptimizerState(self, request, context):
        stage = self.stage_for(request.deployment_id)
        state = await self._run(stage.optimizer_state)
        header = shard_pb2.OptimizerStateHeader(deployment_id=request.deployment_id, layout=state.layout())
        for frame in wire.framed(shard_pb2.OptimizerStateMessage, header, state.tensors,
                                 wire.SendOptions(self.settings.chunk_bytes)):
            yield frame  # exact, as weights

    @boundary
    async def LoadOptimizerState(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        stage = self.stage_for(header.deployment_id)
        state = optim.KeyedState.parse(header.layout, await reader.tensors())
        await self._run(stage.load_optimizer_state, state, header.check_only)
        return shard_pb2.LoadOptimizerStateResponse()

    @boundary
    async def Forward(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        stage = self.stage_for(header.key.deployment_id)
        if header.HasField("plan"):
            raise InvalidArgument("a planned step's forwards travel on Links, not on Forward calls")
        key = (header.key.step, header.key.microbatch)
        # The header goes on at once, so later stages fetch their residuals and apply a deferred optimizer
        # step while this one computes.
        downstream = self.links.open_forward(header) if self._plan.next_address else None
        stepping = asyncio.ensure_future(self.apply_step(stage, header.step_first)) \
            if header.HasField("step_first") else None
        try:
            x, incoming = await self._inputs(stage, header.key, reader)
            if stepping is not None:
                await stepping
            await self._order.after_optimizer_step(header.after_optimizer_step, self.settings.timeouts.peer_wait)
            if header.zero_grad:
                await self._run(stage.zero_grad)
            result, outgoing = await self._run(stage.forward, key, x, incoming, header.requires_grad,
                                               header.input_requires_grad, not header.eval_mode)
            self.offer_residuals(stage, key, outgoing)
            if header.requires_grad and self._plan.previous_address:
                self._backward_links.add(key, self.links.open_backward(header.key))
            if downstream is None:
                self._outbox.put((*key, OUTPUT), [result, 1])
            else:
                same_host = self.links.peer(self._plan.next_address).same_host
                await downstream.send({"activation": result}, self.links.options(same_host, "activations"))
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
        tensor = await self.links.fetch_residual(key, name)
        producer = self.links.producer(name).producer_stage
        stage.incoming_spec(name).check(tensor, f"residual {name!r} from stage {producer}")
        return tensor

    @boundary
    async def FetchTensor(self, request, context):
        self.stage_for(request.key.deployment_id)
        key = (request.key.step, request.key.microbatch, request.name)
        what = f"tensor {request.name!r} of step {request.key.step} micro-batch {request.key.microbatch}"
        entry = await self._outbox.get(key, self.settings.timeouts.peer_wait, what)
        kind = _FETCHED_KINDS.get(request.name, "residuals")
        options = self.links.options(request.shared_memory, kind)
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
        stage = self.stage_for(header.key.deployment_id)
        failure = "cancelled"
        try:
            await self._backward(stage, header, reader)
            failure = ""
        except Exception as error:
            failure = str(error)
            raise
        finally:
            await self._order.backward_finished(header.key.step, failure)
        return shard_pb2.BackwardResponse()

    async def _backward(self, stage: Stage, header, reader: RequestReader) -> None:
        """This stage's backward, then (concurrently) the previous stage's and the residual producers'."""
        grad_output = (await reader.tensors()).get("gradient")
        key = (header.key.step, header.key.microbatch)
        if header.zero_grad:
            await self._run(stage.zero_grad)
        residual_grads = await self.residual_gradients(stage, key)
        grad_input, incoming_grads = await self._run(stage.backward, key, grad_output, residual_grads)
        calls = [self.links.send_residual_grad(header.key, name, grad) for name, grad in incoming_grads.items()]
        if not self._plan.previous_address and grad_input is not None:
            self._outbox.put((*key, INPUT_GRADIENT), [grad_input, 1])
        if self._plan.previous_address:
            link = self._backward_links.pop(key)
            if link is not None and header.zero_grad:
                link.abandon()  # its header went out at forward time: the previous stage must clear its gradients too
                link = None
            link = link or self.links.open_backward(header.key, header.zero_grad)
            same_host = self.links.peer(self._plan.previous_address).same_host
            calls.append(link.send({"gradient": grad_input} if grad_input is not None else {},
                                   self.links.options(same_host, "gradients")))
        await asyncio.gather(*calls)

    @boundary
    async def AccumulateGradient(self, request_iterator, context):
        reader = RequestReader(request_iterator, self.settings.timeouts.rpc)
        header = await reader.header()
        grad = (await reader.tensors()).get(header.name) if header.has_gradient else None
        await self.accumulate(header.key, header.name, grad)
        return shard_pb2.AccumulateGradientResponse()

    async def accumulate(self, key: shard_pb2.StepKey, name: str, grad: torch.Tensor | None) -> None:
        """Adds one consumer's gradient of residual `name`; the sum is ready once every consumer sent its own."""
        stage = self.stage_for(key.deployment_id)
        if name not in stage.residuals.outgoing:
            raise InvalidArgument(f"stage {stage.index} did not produce residual {name!r}; "
                                  f"it produces {sorted(stage.residuals.outgoing)}")
        entry = (key.step, key.microbatch, name)
        received = self._residual_grads.setdefault(entry, [])
        received.append(grad)
        if len(received) == len(stage.residuals.outgoing[name]):
            del self._residual_grads[entry]
            present = [g for g in received if g is not None]
            self._gradients.put(entry, sum(present[1:], present[0]) if present else None)

    @boundary
    async def Step(self, request, context):
        await self.apply_step(self.stage_for(request.deployment_id), request)
        return shard_pb2.StepResponse()

    async def apply_step(self, stage: Stage, request) -> None:
        """Steps the optimizer once this stage's share of the listed backwards has succeeded."""
        try:
            failures = await self._order.backward_failures(request.backward_steps, self.settings.timeouts.peer_wait)
            if failures:
                step, reason = next(iter(failures.items()))
                raise FailedPrecondition(f"optimizer step {request.optimizer_step} not applied: the backward of "
                                         f"step {step} failed: {reason}")
            if request.zero_grad:
                await self._run(stage.zero_grad)
            await self._run(stage.step)
        finally:
            await self._order.optimizer_step_settled(request.optimizer_step)
            await self.forget(stage, request.step)

    async def forget(self, stage: Stage, up_to_step: int) -> None:
        """Drops every leftover of steps up to `up_to_step` (forwards whose backward never came, failed steps)."""
        await self._run(stage.forget, up_to_step)
        stale = lambda key: key[0] <= up_to_step  # noqa: E731 - a one-line predicate
        self._outbox.discard_where(stale)
        self._gradients.discard_where(stale)
        for key in [k for k in self._residual_grads if stale(k)]:
            del self._residual_grads[key]
        self.loop.forget(up_to_step)
        self._backward_links.abandon_where(stale)
        self._order.forget(up_to_step)

    def loss(self, spec: shard_pb2.LossSpec) -> tuple:
        """The loss function of a LossSpec and whether it sums, built once per distinct spec."""
        cache_key = spec.SerializeToString(deterministic=True)
        if cache_key not in self._losses:
            if spec.name:
                self._losses[cache_key] = losses.build(spec.name, spec.kwargs_json)
            elif spec.program.program:
                self._losses[cache_key] = (CapturedProgram(spec.program.program).load({}), spec.sums)
            else:
                raise InvalidArgument("a planned step's last stage needs a loss: a name or a captured program")
        return self._losses[cache_key]

    @property
    def _plan(self) -> shard_pb2.StagePlan:
        return self.links.plan

    @property
    def plan(self) -> shard_pb2.StagePlan:
        """Where this shard's stage sits: neighbours and residual traffic."""
        return self.links.plan

    @property
    def order(self) -> StepOrder:
        """What this shard has settled: optimizer steps and backwards."""
        return self._order

    @boundary
    async def Link(self, request_iterator, context):
        roles = auth.caller_roles(context, self.settings.security)

        def opened(opening: shard_pb2.LinkOpen, end: link.LinkEnd) -> None:
            needed = auth.SHARD if opening.role in _STAGE_LINKS else auth.CLIENT
            if needed not in roles:
                raise PermissionDenied(f"a {shard_pb2.LinkRole.Name(opening.role)} link takes the {needed} role's "
                                       f"token; this caller has the {' or '.join(sorted(roles))} role")
            self.loop.opened(opening, end)
        await link.serve(request_iterator, context, f"link to {self.location}", opened,
                         self.loop.on_item, self.loop.closed, self.local_links)

    async def run(self, function, *args):
        """Stage work, one piece at a time."""
        return await self._run(function, *args)

    async def fetch_residuals(self, stage: Stage, key: shard_pb2.StepKey) -> dict:
        """Every residual this stage consumes for a micro-batch, fetched from their producers at once."""
        names = list(stage.residuals.incoming)
        fetched = await asyncio.gather(*(self._fetch_residual(stage, key, name) for name in names))
        return dict(zip(names, fetched))

    def offer_residuals(self, stage: Stage, key, outgoing: dict) -> None:
        """Leaves a micro-batch's residuals for the stages that consume them."""
        for name, tensor in outgoing.items():
            self._outbox.put((*key, name), [tensor, len(stage.residuals.outgoing[name])])

    async def residual_gradients(self, stage: Stage, key) -> dict:
        """The gradients of the residuals this stage produced, once every consumer has sent its own."""
        grads = {}
        for name in stage.residuals.outgoing:
            what = f"gradient of residual {name!r} for step {key[0]} micro-batch {key[1]}"
            grads[name] = await self._gradients.get((*key, name), self.settings.timeouts.peer_wait, what)
        return grads

    async def averager_call(self, name: str) -> None:
        """Runs the replicas' averager's `name` ("connect" before a planned step, "finish" after its backwards)."""
        if self._averager is not None:
            await self._run(getattr(self._averager, name))

    def averager_arm(self, last_microbatch: bool) -> None:
        """Before a backward: on the last micro-batch, gradients are final and all-reduce as they appear."""
        if self._averager is not None:
            self._averager.arm(last_microbatch)

    @boundary
    async def Describe(self, request, context):
        stage = self._stage
        return shard_pb2.DescribeResponse(
            address=self.address, device=self.settings.device, deployment_id=self._deployment_id,
            stage=stage.index if stage else -1, layer_indexes=stage.layer_indexes if stage else [],
            in_flight_steps=[key[0] for key in stage.in_flight_steps] if stage else [],
            parameter_count=stage.parameter_count if stage else 0, flush_denormal=self.settings.flush_denormal)

    @boundary
    async def ProbeSharedMemory(self, request, context):
        return shard_pb2.ProbeSharedMemoryResponse(token=shm.read_probe(request.path), uid=os.getuid())

    async def close(self) -> None:
        """Closes peer channels, the compute thread and this shard's shared segments."""
        await self.loop.close()
        await self.links.close()
        if self.local_links is not None:
            await self.local_links.close()
        self._compute.shutdown(wait=False, cancel_futures=True)
        if self._averager is not None:
            self._averager.close()
