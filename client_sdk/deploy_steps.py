"""The steps of Cluster.deploy that need no coordinator: check the options, capture the model, plan its DeployRequest,
describe its layers for the partitioner, build the handle to what the coordinator placed, and load its weights."""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from client_sdk import layers as layer_tools
from client_sdk import materialize, modes
from client_sdk import optimizer as optimizer_tools
from client_sdk.event_loop import IoLoop
from client_sdk.interface import Interface
from client_sdk.loss_scaling import LossScaler
from client_sdk.model import DistributedModel, Placement, RemoteParameter
from client_sdk.pipeline import PipelineTrainer
from client_sdk.transport import StageClients
from shardtrain import optim, wire
from shardtrain import precision as precision_mode
from shardtrain import recompute_modes
from shardtrain.errors import InvalidArgument
from shardtrain.settings import Security, Timeouts
from shardtrain.v1 import coordinator_pb2

BALANCES = ("time", "parameters")  # measured on the shards, or parameter counts
log = logging.getLogger("shardtrain.client")


@dataclass(frozen=True)
class DeployOptions:
    """Cluster.deploy's choices besides the model and its example (see there), checked."""

    optimizer: object
    compression: str | dict[str, str]
    replicas: int
    balance: str
    split_points: Sequence[int | str]
    layers_per_stage: Sequence[int]
    num_stages: int
    virtual_stages: int
    snapshot_every: int
    take_over: bool
    weights: object  # str | os.PathLike | None
    recompute: str  # the mode; "never" when a list of submodules names what to recompute
    recomputed: list[str]
    precision: str

    @classmethod
    def checked(cls, *, recompute: str | Sequence[str], **options) -> DeployOptions:
        """The options, or InvalidArgument naming the first that is out of range."""
        if options["replicas"] < 1:
            raise InvalidArgument(f"replicas must be at least 1, got {options['replicas']}")
        recomputed = [] if isinstance(recompute, str) else list(recompute)
        mode = recompute_modes.check(recompute) if isinstance(recompute, str) else "never"
        precision_mode.check(options["precision"])
        snapshot_every, virtual_stages = options["snapshot_every"], options["virtual_stages"]
        if not isinstance(snapshot_every, int) or isinstance(snapshot_every, bool) or snapshot_every < 0:
            raise InvalidArgument(f"snapshot_every must be a whole number >= 0, got {snapshot_every!r}")
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise InvalidArgument(f"virtual_stages must be a whole number >= 1, got {virtual_stages!r}")
        return cls(recompute=mode, recomputed=recomputed, **options)

    @property
    def chooses_stages(self) -> bool:
        """Whether the caller chose the stages; if not, a deploy leaves the spares idle and warns of idle shards."""
        return bool(self.num_stages or self.split_points or self.layers_per_stage)


class PhaseClock:
    """Seconds per named phase of a deploy, for model.deploy_seconds and the deploy's log line."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now


@dataclass(frozen=True)
class Captured:
    """A model as a deploy captured it whole: its layers, the interface it is called through, the example's main
    input and other inputs by name, and whether it was built on the meta device (initialised a part at a time)."""

    module: torch.nn.Module
    layers: list
    interface: Interface
    x: torch.Tensor
    inputs: dict
    empty: bool


def capture(module: torch.nn.Module, example_input, example_inputs: tuple, example_kwargs: dict | None,
            dynamic_shapes, weights) -> Captured:
    """The model's layers and interface from its example, warning of Python state the capture fixes."""
    empty = materialize.is_empty(module)  # built on meta: captured from shapes, initialised a part at a time
    if empty:
        if weights is None:
            materialize.check_initialisable(module)
        example_input, example_inputs, example_kwargs = _on_meta((example_input, example_inputs, example_kwargs))
    if layer_tools.is_layered(module):
        layers, interface = layer_tools.layers_of(module), Interface()
        x = example_input if example_input is not None else layer_tools.example_input(module, layers)
        x = x.to("meta") if materialize.is_empty(module) else x
        args, kwargs, bound = (x,), {}, (x, {})
    else:
        args = (example_input,) if isinstance(example_input, torch.Tensor) else tuple(example_inputs)
        kwargs = dict(example_kwargs or {})
        layers, interface = layer_tools.whole_model_layers(module, args, kwargs, dynamic_shapes)
        bound = interface.bind(args, kwargs)
    layer_tools.warn_frozen(module, args, kwargs)  # its stacklevel counts this function and Cluster.deploy
    return Captured(module, layers, interface, *bound, empty)


def plan(captured: Captured, options: DeployOptions) -> coordinator_pb2.DeployRequest:
    """The DeployRequest: every unit's program (captured in both modes), the optimizer's spec, the wire encodings
    and how to partition."""
    module, layers = captured.module, captured.layers
    # Stages chosen: nothing to balance, and the costs shown are parameter counts.
    balance = "parameters" if options.split_points or options.layers_per_stage else options.balance
    balance = balance or ("parameters" if layer_tools.is_layered(module) else "time")
    if balance not in BALANCES:
        raise InvalidArgument(f"balance must be one of {list(BALANCES)}, got {balance!r}")
    mixed = modes.mixed_modes(module)
    if mixed:
        warnings.warn(f"layers {mixed[:5]} are not in the model's {'training' if module.training else 'eval'} "
                      "mode: the deployment switches the whole model, as model.train() and model.eval() do",
                      stacklevel=3)
    spec = optimizer_tools.spec_for(options.optimizer, dict(module.named_parameters()))
    precision, compression = options.precision, options.compression
    encodings = wire.wire_encodings(precision if precision != "fp32" and compression == "none" else compression)
    return coordinator_pb2.DeployRequest(
        encodings=encodings,
        layers=layer_tools.capture_model(module, layers, captured.x, captured.inputs),
        optimizer=spec,
        partition=coordinator_pb2.PartitionSpec(num_stages=options.num_stages,
                                                split_points=layer_tools.split_indexes(layers, options.split_points),
                                                layers_per_stage=options.layers_per_stage,
                                                balance_by_time=balance == "time",
                                                virtual_stages=options.virtual_stages),
        replicas=options.replicas, inputs=captured.interface.extra_inputs, outputs=captured.interface.outputs,
        take_over=options.take_over, recompute=options.recompute, precision=precision)


def describe(request: coordinator_pb2.DeployRequest, captured: Captured, options: DeployOptions) -> None:
    """Marks what each captured layer holds and recomputes, and what the partitioner weighs: its inputs' shapes
    (to time it on the shards) and its memory."""
    layer_tools.mark_state(request.layers, captured.module)
    layer_tools.mark_recomputed(captured.layers, request.layers, options.recomputed)
    if request.partition.balance_by_time:
        layer_tools.describe_inputs(captured.module, captured.layers, request.layers, captured.x, captured.inputs)
    layer_tools.weigh(request.layers, captured.layers, optim.STATE_TENSORS[request.optimizer.name])


@dataclass(frozen=True)
class Shipped:
    """What a handle to any deployment of `request` needs besides the coordinator's answer (a redeploy after a dead
    shard builds one from it too)."""

    request: coordinator_pb2.DeployRequest
    parameter_keys: list[str]  # torch.optim numbers its state by this order: the groups', or net.parameters()'
    shapes: dict[str, tuple]  # each parameter's (shape, dtype, requires_grad)
    model_keys: list[str]  # the model's state-dict keys, in its order
    interface: Interface

    @classmethod
    def of(cls, request: coordinator_pb2.DeployRequest, captured: Captured) -> Shipped:
        module = captured.module
        parameter_keys = [key for group in request.optimizer.groups for key in group.parameters] or \
            [name for name, _ in module.named_parameters()]
        shapes = {name: (tuple(p.shape), p.dtype, p.requires_grad) for name, p in module.named_parameters()}
        return cls(request, parameter_keys, shapes, list(module.state_dict()), captured.interface)


async def connect(response: coordinator_pb2.DeployResponse, shipped: Shipped, io: IoLoop, security: Security,
                  timeouts: Timeouts) -> DistributedModel:
    """The handle to the deployment `response` describes: where each stage went, a client per replica."""
    captured = shipped.request.layers
    owners, holders, placements = {}, {}, []
    for stage in (s for s in response.stages if s.replica == 0):
        held = captured[stage.first_layer:stage.end_layer]
        keys = tuple(dict.fromkeys(entry.model_key for layer in held for entry in layer.state))
        for key in keys:
            owners.setdefault(key, []).append(stage.stage)
        for entry in (entry for layer in held for entry in layer.state):  # a tied weight: on every stage using it
            holders.setdefault(entry.tied_to or entry.model_key, set()).add(stage.stage)
        placements.append(Placement(stage.stage, stage.shard_address, stage.first_layer, stage.end_layer,
                                    tuple(layer.description for layer in held),
                                    stage.cost, response.cost_unit, tuple(stage.layer_costs), keys))
    replicas = []
    for replica in range(max(s.replica for s in response.stages) + 1):
        addresses = [s.shard_address for s in response.stages if s.replica == replica]
        replicas.append(StageClients(response.deployment_id, addresses, security, timeouts,
                                     shipped.request.encodings, response.deployment_secret))
    await asyncio.gather(*(clients.probe() for clients in replicas))
    key_order = [key for key in shipped.model_keys if key in owners]  # state_dict(): the model's keys, in its order
    parameters = [RemoteParameter(name, shape, dtype, requires_grad, tuple(sorted(holders.get(name, ()))))
                  for name, (shape, dtype, requires_grad) in shipped.shapes.items()]
    return DistributedModel(io, PipelineTrainer(replicas), placements, owners, key_order, shipped.parameter_keys,
                            shipped.request.optimizer, {key: sorted(stages) for key, stages in holders.items()},
                            parameters, shipped.interface)


def load(distributed: DistributedModel, captured: Captured, request: coordinator_pb2.DeployRequest,
         options: DeployOptions) -> None:
    """Gives the stages their weights: read by the shards from `options.weights`, initialised here a module at a
    time for a model on meta, or the model's own; then the optimizer's state, if an optimizer instance came."""
    module, layers = captured.module, captured.layers
    if options.weights is not None:
        beyond = layer_tools.held_beyond_state_dict(module, layers, request.layers)
        beyond = materialize.initialise_buffers(module, beyond) if captured.empty else beyond
        distributed.load_weights(options.weights)  # all but these, which no checkpoint holds
        if beyond:
            distributed.load_state_dict(beyond, strict=False)
    elif captured.empty:
        _initialise(distributed, captured, request)
    else:  # a non-persistent buffer (a mask, a rotary cache) is not in the state dict; its stages need its value
        distributed.load_state_dict({**module.state_dict(),
                                     **layer_tools.held_beyond_state_dict(module, layers, request.layers)})
    optimizer = options.optimizer
    if isinstance(optimizer, torch.optim.Optimizer) and optimizer.state:
        distributed.load_optimizer_state_dict(optimizer.state_dict())


def ready(distributed: DistributedModel, captured: Captured, request: coordinator_pb2.DeployRequest,
          options: DeployOptions, clock: PhaseClock) -> None:
    """Sets the handle as the model was (its mode, its batch norms) and as deployed, and logs where the time went."""
    distributed.deploy_seconds = clock.seconds
    log.info("deployed %d layers over %d stages in %.2f s: %s", len(request.layers), len(distributed.placements),
             sum(clock.seconds.values()), ", ".join(f"{k} {v:.2f} s" for k, v in clock.seconds.items()))
    module = captured.module
    distributed.train(module.training)
    distributed.virtual_stages = options.virtual_stages
    distributed.batch_norms = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())
    distributed.snapshot_every = options.snapshot_every
    distributed.loss_scaler = LossScaler() if options.precision == "fp16" else None


def _initialise(distributed: DistributedModel, captured: Captured, request: coordinator_pb2.DeployRequest) -> None:
    """A model on meta: the forward's own constants (no module's tensors) first, then module by module."""
    module = captured.module
    owned = {key for key, _ in (*module.named_parameters(remove_duplicate=False),
                                *module.named_buffers(remove_duplicate=False))}
    constants = {key: value for layer in captured.layers for key, value in layer.constants if key not in owned}
    if constants:
        distributed.load_state_dict(materialize.initialise_buffers(module, constants), strict=False)
    materialize.initialise_in_parts(module, [{entry.model_key for entry in layer.state} - set(constants)
                                             for layer in request.layers],
                                    lambda part: distributed.load_state_dict(part, strict=False))


def _on_meta(values):
    """The same structure with every tensor moved to the meta device (examples for a model built there)."""
    return torch.utils._pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, values)
