"""What a shard is, apart from how calls reach it: the loaded stage and its plan, its compute thread, the current
deployment's runtime (runtime.py) and its waits, its replicas' averager and losses, and the residual gradients it
gathers. The Link loop (link_dispatch.py) and the gRPC servicer (servicer.py) both work through one Shard; it knows
neither, nor gRPC: its peers' channels are theirs (peers.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from shard_service.device import Device, stage_memory
from shard_service.load_checks import check_load
from shard_service.mailbox import Mailbox
from shard_service.ordering import StepOrder
from shard_service.replicas import GradientAverager
from shard_service.runtime import DeploymentRuntime
from shard_service.stage import LayerSource, Stage
from shard_service.step_meter import StepMeter
from shardtrain import allowed_losses, logs, metrics
from shardtrain.capture import CapturedProgram
from shardtrain.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from shardtrain.residuals import StageResiduals, Wiring
from shardtrain.settings import ShardSettings
from shardtrain.v1 import shard_pb2, tensor_pb2

log = logging.getLogger("shardtrain.shard")
INLINE_SECONDS = 5e-3


def work_kind(name: str, arguments) -> str:
    """The kind of a piece of work: its name, and the size of its tensor arguments to a power of two."""
    size = sum(argument.numel() for argument in arguments if isinstance(argument, torch.Tensor))
    return f"{name} of under 2^{size.bit_length()} elements" if size else name


def _with_threads(threads: int, function, *args):
    """Runs `function` with `threads` intra-op threads (a per-thread OpenMP setting: set where it runs);
    returns its result and how long it ran (there, not counting the hand-off to and from the compute thread)."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    return function(*args), time.perf_counter() - start


def summed(grads: list) -> torch.Tensor | None:
    """The sum of the gradients that are not None, added in the order given (so that every party adding the same
    list gets the same bits); None if all are."""
    present = [grad for grad in grads if grad is not None]
    return sum(present[1:], present[0]) if present else None


class Shard:
    """One shard's stage and the state around it, for the current deployment."""

    def __init__(self, settings: ShardSettings, address: str, device: Device | None = None):
        self.settings = settings
        self.address = address
        self.deployment_id = ""
        self.secret = ""                # what calls on the deployment must carry (auth.check_deployment)
        self._stage: Stage | None = None
        self._plan = shard_pb2.StagePlan()
        self._gradients = Mailbox()     # residual gradients, waiting for this stage's backward
        self._residual_grads: dict[tuple, list] = {}  # received so far, per (step, microbatch, name)
        self._averager: GradientAverager | None = None  # this stage's replicas, when data parallel
        self._losses: dict[bytes, tuple] = {}
        self.deployment = DeploymentRuntime()  # what the deployment has settled and its planned steps: sans-IO
        self.order = StepOrder(self.deployment)  # its waits, on the event loop
        self.steps = StepMeter()        # the training forwards since the last optimizer step, for metrics
        self.forgetters: list[Callable[[int], None]] = []  # what else drops a step's leftovers (loop, servicer)
        self._durations: dict[str, float] = {}
        self._threads = settings.threads or torch.get_num_threads()
        # One device, one thread, in order (shared with this process's other stages, --virtual-stages). OpenMP
        # thread counts are per thread, so _with_threads sets the count where the work runs: set only in the
        # main thread, the compute thread would start a team per core and spin against the other shards.
        self.device = device or Device()
        self._owns_device = device is None
        # What one stage here may use: no tensor it is sent may be larger.
        self.memory_budget = stage_memory(settings)

    def fits(self, header: tensor_pb2.TensorHeader) -> None:
        """ResourceExhausted for a tensor larger than a stage here may hold, before any of it is stored."""
        if self.memory_budget and header.nbytes > self.memory_budget:
            raise ResourceExhausted(f"tensor {header.name[:80]!r} of {header.nbytes} bytes is more than a stage "
                                    f"on this shard may hold ({self.memory_budget} bytes, --memory)")

    def fields(self, **more) -> dict:
        """A log record's structured fields (logs.fields): the deployment and stage held here, if any, and `more`."""
        held = {"deployment": self.deployment_id, "stage": self._stage.index} if self._stage is not None else {}
        return logs.fields(**held, **more)

    @property
    def location(self) -> str:
        """How errors name this shard."""
        stage = f"stage {self._stage.index}" if self._stage else "no stage loaded"
        return f"shard {self.address} ({stage})"

    @property
    def plan(self) -> shard_pb2.StagePlan:
        """Where this shard's stage sits: neighbours, residual traffic, tied weights."""
        return self._plan

    def producer(self, name: str) -> shard_pb2.ResidualSource:
        """Where residual `name` comes from."""
        return next(r for r in self._plan.incoming_residuals if r.name == name)

    @property
    def stage(self) -> Stage | None:
        """The loaded stage, if any."""
        return self._stage

    async def run(self, function, *args):
        """Runs stage work one piece at a time, in arrival order.

        Work that took under INLINE_SECONDS last time runs on the event loop itself: handing it to
        the compute thread and back costs two thread wake-ups, which on a busy host take longer than
        small work itself. Longer work goes to the compute thread so the loop keeps reading streams
        (a planned step's next micro-batch) and serving deadlines meanwhile.
        """
        async with self.device.lock:
            name = work_kind(function.__name__, args)
            if self._durations.get(name, INLINE_SECONDS) < INLINE_SECONDS:
                result, elapsed = _with_threads(self._threads, function, *args)
            else:
                result, elapsed = await asyncio.get_running_loop().run_in_executor(
                    self.device.executor, _with_threads, self._threads, function, *args)
            self._durations[name] = elapsed
            metrics.work(function.__name__, elapsed)
            if metrics.enabled() and self._stage is not None:
                metrics.activation_bytes(self._stage.in_flight_bytes)
            return result

    def stage_for(self, deployment_id: str) -> Stage:
        """The stage, if it belongs to `deployment_id`; FailedPrecondition otherwise."""
        if self._stage is None:
            raise FailedPrecondition("no stage is loaded here; deploy a model first")
        if deployment_id != self.deployment_id:
            raise FailedPrecondition(f"this shard holds deployment {self.deployment_id!r}, "
                                     f"not {deployment_id!r}; the model was redeployed")
        return self._stage

    async def load(self, request: shard_pb2.LoadStageRequest) -> shard_pb2.LoadStageResponse:
        """Builds the stage a LoadStage asks for and drops everything of the previous deployment."""
        check_load(request)
        sources = [LayerSource(layer.index, layer.description, layer.program,
                               Wiring(tuple(layer.dependencies), tuple(layer.out_variables)),
                               {entry.graph_key: entry.model_key for entry in layer.state}, layer.eval_program,
                               {entry.model_key: entry.tied_to for entry in layer.state if entry.tied_to},
                               frozenset(entry.model_key for entry in layer.state if entry.frozen), layer.recompute)
                   for layer in request.layers]
        plan = request.plan
        residuals = StageResiduals({r.name: r.producer_stage for r in plan.incoming_residuals},
                                   {r.name: list(r.consumer_stages) for r in plan.outgoing_residuals})
        groups = [(tuple(group.parameters), group.options_json) for group in request.optimizer.groups]
        optimizer = (request.optimizer.name, request.optimizer.kwargs_json, groups)
        stage = await self.run(Stage, plan.stage, sources, residuals, optimizer, self.settings.device,
                               self.settings.max_in_flight, request.recompute or "never",
                               request.precision or "fp32")
        stage.computes_loss = plan.stage == plan.num_stages - 1
        self._stage, self.deployment_id, self.secret = stage, request.deployment_id, request.deployment_secret
        self._plan = plan
        self._gradients.discard_where(lambda key: True)
        self._residual_grads.clear()
        self._losses.clear()  # built for the previous deployment's last stage
        if self._averager is not None:
            self._averager.close()
        # Off the event loop: joining a replica's rendezvous store blocks until it answers or times out.
        self._averager = await asyncio.to_thread(GradientAverager.for_plan, plan, stage, self.address,
                                                 self.settings.timeouts.peer_wait, request.deployment_secret)
        self.deployment = DeploymentRuntime(request.deployment_id)
        self.order = StepOrder(self.deployment)
        self.steps.clear()
        log.info("loaded stage %d (layers %s) of deployment %s", plan.stage, stage.layer_indexes,
                 request.deployment_id, extra=self.fields())
        return shard_pb2.LoadStageResponse(parameter_count=stage.weights.parameter_count,
                                           rendezvous=self._averager.hosted if self._averager else "")

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
            self._gradients.put(entry, summed(received))

    async def residual_gradients(self, stage: Stage, key) -> dict:
        """The gradients of the residuals this stage produced, once every consumer has sent its own."""
        grads = {}
        for name in stage.residuals.outgoing:
            what = f"gradient of residual {name!r} for step {key[0]} micro-batch {key[1]}"
            grads[name] = await self._gradients.get((*key, name), self.settings.timeouts.peer_wait, what)
        return grads

    async def forget(self, stage: Stage, up_to_step: int) -> None:
        """Drops every leftover of steps up to `up_to_step` (forwards whose backward never came, failed steps)."""
        if stage is not self._stage:
            return  # a previous deployment's work, ended by a LoadStage: the step numbers here are the new one's
        await self.run(stage.forget, up_to_step)
        stale = lambda key: key[0] <= up_to_step  # noqa: E731 - a one-line predicate
        self._gradients.discard_where(stale)
        for key in [k for k in self._residual_grads if stale(k)]:
            del self._residual_grads[key]
        for forget in self.forgetters:
            forget(up_to_step)
        self.order.forget(up_to_step)

    async def backwards_over(self, steps, what: str) -> None:
        """Waits until the listed backwards are over here; FailedPrecondition, naming `what`, if one failed."""
        failures = await self.order.backward_failures(steps, self.settings.timeouts.peer_wait)
        if failures:
            step, reason = next(iter(failures.items()))
            raise FailedPrecondition(f"{what}: the backward of step {step} failed: {reason}")

    def loss(self, spec: shard_pb2.LossSpec) -> tuple:
        """The loss function of a LossSpec and whether it sums, built once per distinct spec."""
        cache_key = spec.SerializeToString(deterministic=True)
        if cache_key not in self._losses:
            if spec.name:
                self._losses[cache_key] = allowed_losses.build(spec.name, spec.kwargs_json)
            elif spec.program.program:
                self._losses[cache_key] = (CapturedProgram(spec.program.program).load({}), spec.sums)
            else:
                raise InvalidArgument("a planned step's last stage needs a loss: a name or a captured program")
        return self._losses[cache_key]

    async def averager_call(self, name: str):
        """Runs the replicas' averager's `name` ("connect" before a planned step, which answers the collectives'
        backend, "finish" after its backwards). Both wait for the other replicas, not for this device: they run
        outside its lock, so that the device's other work, a snapshot or a new LoadStage is not held up by a
        replica that died. A group already joined answers "connect" at once, without the hop to a thread."""
        if self._averager is None:
            return None
        if name == "connect" and self._averager.connected:
            return self._averager.backend
        return await asyncio.to_thread(getattr(self._averager, name))

    def averager_arm(self, last_microbatch: bool) -> None:
        """Before a backward: on the last micro-batch, gradients are final and all-reduce as they appear."""
        if self._averager is not None:
            self._averager.arm(last_microbatch)

    async def close(self) -> None:
        """Closes the compute thread (if the device is this shard's alone) and the replicas' averager."""
        if self._owns_device:
            self.device.close()
        if self._averager is not None:
            self._averager.close()
