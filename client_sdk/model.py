"""A deployed model that looks like a local one: call it, backpropagate into it, step it."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from client_sdk import recovery
from client_sdk.call_order import CallOrder
from client_sdk.event_loop import IoLoop
from client_sdk.gradients import RemoteGradient, RemoteGradients
from client_sdk.interface import Interface
from client_sdk.model_state import ModelState, StateMethods
from client_sdk.optimizer import Hyperparameters, client_optimizer
from client_sdk.pipeline import PipelineTrainer
from client_sdk.planned_steps import PlannedSteps, TrainingMethods
from client_sdk.reports import ReportMethods
from client_sdk.script_loop import LoopMethods, ScriptLoop
from shardtrain.errors import FailedPrecondition, InvalidArgument
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.sdk")


@dataclass(frozen=True)
class RemoteParameter:
    """A parameter of a deployed model: what it is and which stages hold it (its value: model.state_dict())."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool  # False: frozen when deployed (it was in the model), so it takes no gradient
    stages: tuple[int, ...]  # more than one for a weight tied across stages

    gradients: RemoteGradients | None = field(default=None, compare=False, repr=False)

    @property
    def grad(self) -> RemoteGradient | None:
        """The parameter's gradient, held by its shards, once a backward ran (None before, after zero_grad, or
        when frozen): torch.nn.utils.clip_grad_norm_(model.parameters(), ...) and clip_grad_value_ run on these
        there (client_sdk/gradients.py); the next step() applies what they did."""
        if self.gradients is None or not self.requires_grad or not self.gradients.present():
            return None
        return RemoteGradient(self.name, self.shape, self.dtype, self.gradients)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Placement:
    """Where one stage runs and which layers it holds."""

    stage: int
    shard_address: str
    first_layer: int
    end_layer: int
    layers: tuple[str, ...]
    cost: int = 0  # what the partitioner balanced: the stage's time as its shard measured it, or its parameters
    cost_unit: str = "parameters"
    layer_costs: tuple[int, ...] = ()  # the same per layer
    state_keys: tuple[str, ...] = ()  # the weights and buffers it holds, by state-dict key (a tied one on each)


# The handle's methods come by what they do, each from the module doing that work: the loop (script_loop.py), state
# and checkpoints (model_state.py), train_step and fit (planned_steps.py), reports (reports.py). The class itself
# holds the deployment, the parameters, the mode and the lifecycle.
class DistributedModel(LoopMethods, StateMethods, TrainingMethods, ReportMethods):
    """Handle to a deployed model. Synchronous methods block; `a`-prefixed ones are awaitable.

    Training loop, as in PyTorch:  pred = model(x); loss.backward(); model.step(); model.zero_grad()
    Explicit async loop:  pred = await model.aforward(x); loss.backward(); await model.abackward(pred.grad);
                          await model.astep()

    Everything travels on two long-lived Link streams (into the first stage and into the last). The
    synchronous loop does not wait for backward or step to finish: each shard orders the work itself,
    and the client runs at most one iteration ahead. An error raised by a shard surfaces at the next
    call into the model; synchronize() waits for everything sent so far.
    """

    def __init__(self, io: IoLoop, trainer: PipelineTrainer, placements: Sequence[Placement],
                 owners: dict[str, list[int]], key_order: Sequence[str], parameter_keys: Sequence[str] = (),
                 optimizer: shard_pb2.OptimizerSpec | None = None, holders: dict[str, list[int]] | None = None,
                 parameters: Sequence[RemoteParameter] = (), interface: Interface | None = None):
        # What the handle holds of its deployment; a redeploy after a dead shard replaces these (PlannedSteps._adopt).
        self._io = io
        self._trainer = trainer
        self._clients = trainer.replicas[0]  # the PyTorch-shaped loop drives replica 0 (the only one then)
        self.placements = list(placements)
        self._call_order = CallOrder()  # the call-order state a script's calls move through
        self._closed = False
        self.virtual_stages = 1  # stages per device (deploy(virtual_stages=)), for the interleaved schedule
        self._interface = interface or Interface()  # the model's arguments and outputs
        # The handle's work, by what it does; each reaches the deployment through the handle.
        self._script_loop = ScriptLoop(self)
        self._planned_steps = PlannedSteps(self)
        self._model_state = ModelState(self, owners, key_order, parameter_keys, holders)
        self._gradients = RemoteGradients(
            {p.name: list(p.stages) for p in parameters if p.requires_grad and p.stages},
            self._script_loop.parameter_norms,
            lambda: self._trainer.scaler.scale if self._trainer.scaler is not None else 1.0,
            lambda: self._call_order.has_gradients)
        self._parameters = [replace(parameter, gradients=self._gradients) for parameter in parameters]
        # The shards' optimizer as seen from here: its param groups hold the hyperparameters in force.
        self.optimizer = client_optimizer(optimizer or shard_pb2.OptimizerSpec(name="SGD", kwargs_json='{"lr": 0.01}'),
                                          self.step, self.zero_grad)
        self._hyperparameters = Hyperparameters(self.optimizer)
        # train_step survives a dead shard (client_sdk/recovery.py) through the cluster's redeploy.
        self._redeploy: recovery.Redeploy | None = None
        self.recoveries: list[recovery.Recovery] = []  # the dead shards replaced so far, and what it took
        # Without replicas: every snapshot_every train_step calls each stage snapshots itself (client_sdk/recovery.py).
        self.snapshot_every = 0
        self.steps_done = 0  # train_step calls whose step the model holds (after a roll-back, the snapshot's)
        self.training = True  # as nn.Module's: train() and eval() set it; every forward says which graphs run
        self.batch_norms = False  # the model has batch norms: train_step with micro-batches warns once
        self.deploy_seconds: dict[str, float] = {}  # where the deploy's time went, by phase

    @property
    def deployment_id(self) -> str:
        """The coordinator's id for this deployment."""
        return self._clients.deployment_id

    def train(self, mode: bool = True) -> DistributedModel:
        """Training mode (Dropout drops, BatchNorm normalises by the batch and updates its running statistics),
        or eval mode with mode=False; as nn.Module.train, for every layer on every shard. Returns the model."""
        if not isinstance(mode, bool):
            raise InvalidArgument(f"train(mode) takes True or False, got {mode!r}")
        self.training = mode
        return self

    def eval(self) -> DistributedModel:
        """Eval mode (model.train(False)): Dropout passes its input on, BatchNorm uses its running statistics."""
        return self.train(False)

    def named_parameters(self):
        """(name, RemoteParameter) for each parameter, in net.named_parameters()'s order (a tied weight once)."""
        return ((parameter.name, parameter) for parameter in self._parameters)

    def parameters(self):
        """Each RemoteParameter, in net.parameters()'s order: sum(p.numel() for p in model.parameters()) counts
        the model's weights, as for a local module."""
        return iter(self._parameters)

    # -- lifecycle ---------------------------------------------------------------------------
    async def _synchronize(self) -> None:
        """Waits until every shard has finished everything sent so far (on the IoLoop)."""
        await self._trainer.flush()
        await self._call_order.inflight.drain()

    def _settle(self) -> None:
        """Waits for the calls still in flight; a failure among them is logged, not raised (a deploy is next)."""
        if self._closed:
            return
        try:
            self._io.run(self._synchronize())
        except Exception as error:  # noqa: BLE001 - reported already, or moot once another model is deployed
            log.warning("deployment %s: calls still in flight failed: %s", self.deployment_id, error)

    def close(self) -> None:
        """Waits for calls still in flight, then closes the channels (the shards keep the model)."""
        if not self._closed:
            self._closed = True
            self._io.run(_close(self))

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition(f"deployment {self.deployment_id} is closed: the cluster was closed or "
                                     "deployed another model; use the handle the latest deploy returned")

    def __repr__(self) -> str:
        stages = ", ".join(f"stage {p.stage}@{p.shard_address}: layers {p.first_layer}-{p.end_layer - 1}"
                           for p in self.placements)
        return f"DistributedModel({self.deployment_id}; {stages})"


async def _close(model: DistributedModel) -> None:
    """model.close(): the calls in flight settle (a failure only logged), then every replica's channels close."""
    try:
        await model._synchronize()
    except Exception as error:  # closing must not fail: a broken shard was already reported or is moot now
        log.warning("deployment %s: calls still in flight at close failed: %s", model.deployment_id, error)
    finally:
        await asyncio.gather(*(clients.close() for clients in model._trainer.replicas))
