"""A deployed model that looks like a local one: call it, backpropagate into it, step it."""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from client_sdk import recovery
from client_sdk.call_order import CallOrder
from client_sdk.event_loop import IoLoop
from client_sdk.fit import Fit, History
from client_sdk.gradients import RemoteGradient, RemoteGradients
from client_sdk.interface import Interface
from client_sdk.loss_scaling import LossScaler
from client_sdk.model_state import ModelState
from client_sdk.optimizer import Hyperparameters, client_optimizer
from client_sdk.pipeline import PipelineTrainer
from client_sdk.planned_steps import PlannedSteps
from client_sdk.reports import ShardReport, Table
from client_sdk.script_loop import ScriptLoop
from client_sdk.timeline import Timeline
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


class DistributedModel:
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

    # -- the PyTorch-shaped loop (client_sdk/script_loop.py) ---------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Runs the model on its arguments, as the local model takes them (the tensors the example had); returns
        what it returns (a tensor, or a tuple or dict of them). Under autograd the result backpropagates into the
        shards: into the first input too when it requires grad; the other inputs take no gradient."""
        return self._script_loop.forward(args, kwargs)

    def step(self) -> None:
        """Every shard applies its optimizer to the gradients accumulated so far (nothing, as in PyTorch, when no
        backward ran since the last zero_grad). Outputs not yet backpropagated can no longer be: their graphs hold
        weights the step changed, and their backward raises FailedPrecondition at once, as PyTorch raises."""
        self._script_loop.step()

    def zero_grad(self) -> None:
        """Clears gradients on every shard (to None, as torch does); sent with the next forward, backward or step
        rather than on its own, so it takes effect before any backward called after it."""
        self._script_loop.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every stage's gradients: returns their total norm, and the next step()
        scales every gradient by max_norm / (total + 1e-6) when that is under 1. Waits for the backwards sent."""
        return self._script_loop.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def synchronize(self) -> None:
        """Waits until every shard has finished everything sent so far; raises the first error."""
        self._io.run(self._synchronize())

    # -- weights, optimizer state and checkpoints (client_sdk/model_state.py) -------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights, gathered from the shards, in the original model's key order."""
        return self._model_state.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Pushes weights to the shards that own them."""
        self._model_state.load_state_dict(state, strict)

    def optimizer_state_dict(self) -> dict:
        """The shards' optimizer state (Adam's moments, step counts, hyperparameters...) as torch.optim's
        state_dict() of one optimizer over net.parameters() would hold it. Save it with model.state_dict() to
        resume training exactly; it loads into a local optimizer over the same model too."""
        return self._model_state.optimizer_state_dict()

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Replaces the shards' optimizer state with one from optimizer_state_dict() (or from a local optimizer
        of the same class over net.parameters()); a state that does not fit is refused and changes nothing."""
        self._model_state.load_optimizer_state_dict(state)

    def save_checkpoint(self, directory: str | os.PathLike, on_shards: bool | None = None) -> None:
        """Writes the weights and the optimizer state to `directory` as safetensors files and a JSON description,
        no pickle (shardtrain/checkpoint.py); load_checkpoint reads it into any deployment of the same model.

        Where every stage's shard was started with --checkpoint-dir (Cluster.local(checkpoint_dir=...)) and
        `directory` lies under it, each shard writes its own stage, all at once, and nothing passes through this
        process; otherwise the SDK gathers the state and writes one file of each kind here. `on_shards`: True
        insists on the shards (a relative `directory` is then relative to their --checkpoint-dir), False on this
        process.

        A save replaces a checkpoint already in `directory` whole, with one rename, or not at all. One that fails
        (no room is ResourceExhausted, another I/O error Unavailable, a shard that died) removes what it wrote
        but leaves its generation-* directory: loads of `directory` are then refused until a save succeeds, or
        that directory is removed to load the checkpoint it did not replace. The files are this user's alone
        (0600; a shard's --checkpoint-group lets a group read them)."""
        self._model_state.save_checkpoint(directory, on_shards)

    def load_weights(self, source: str | os.PathLike, provided: Sequence[str] = ()) -> dict[str, int]:
        """Has every stage read its own weights from `source`, where they lie: a safetensors file, a directory,
        a Hugging Face sharded checkpoint (model.safetensors.index.json and its files), on a disk the shards see
        or an s3:// URL, under their --data-root; nothing passes through this process. A directory that
        save_checkpoint wrote loads as load_checkpoint(source, optimizer=False) does. Every stage checks every
        tensor (present under its key or a tied weight's, same dtype and shape) before any stage reads one: a
        source that does not fit is refused, naming the tensor, and changes nothing. What state_dict() leaves out
        (non-persistent buffers), and `provided` keys, are not looked for. Returns the bytes each shard read."""
        return self._model_state.load_weights(source, provided)

    def load_checkpoint(self, directory: str | os.PathLike, optimizer: bool = True,
                        on_shards: bool | None = None) -> None:
        """Loads a checkpoint that save_checkpoint wrote, on this split or another, with the optimizer state unless
        `optimizer` is False; a checkpoint that does not fit the model, whose parts are of different saves or
        steps (DataLoss, naming the stage), or whose directory holds a save that did not finish
        (FailedPrecondition) is refused and changes nothing. The shards read their own tensors where they can, as
        save_checkpoint writes them (`on_shards` as there)."""
        self._model_state.load_checkpoint(directory, optimizer, on_shards)

    def named_parameters(self):
        """(name, RemoteParameter) for each parameter, in net.named_parameters()'s order (a tied weight once)."""
        return ((parameter.name, parameter) for parameter in self._parameters)

    def parameters(self):
        """Each RemoteParameter, in net.parameters()'s order: sum(p.numel() for p in model.parameters()) counts
        the model's weights, as for a local module."""
        return iter(self._parameters)

    # -- planned steps (client_sdk/planned_steps.py) and fit (client_sdk/fit.py) ---------------------
    def train_step(self, x, y: torch.Tensor | None = None, loss_fn="MSELoss", microbatches: int = 1,
                   schedule: str = "1f1b", clip_grad_norm: float | None = None, *, loss_output=None) -> float:
        """One pipelined training step on the shards: zero_grad, forward and backward of every micro-batch,
        the replicas' gradient all-reduce, and the optimizer step. Returns the batch's loss as soon as the
        last stage computed it; the backwards and the optimizer step go on meanwhile, and a failure of
        theirs is raised by the next call into the model, as after the loop's step().

        x: the model's input, or the arguments of a model that takes several: a tuple (positional) or a dict
        (keywords), as model(*x) or model(**x) takes them; or a batch of a DataSource (its target included),
        whose rows each replica's first and last stage read from storage themselves. Every input is split by its
        rows (dim 0) over the replicas, then into `microbatches` pieces (uneven sizes are fine); stage i works
        on micro-batch k+1 while stage i+1 works on k, under `schedule` "1f1b" (stage s holds at most p - s
        micro-batches between forward and backward), "gpipe" (all forwards, then all backwards) or "zb-h1" (1F1B
        with each backward split into the input gradient the stage before waits for and the weight gradient,
        which fills the stage's idle time) or "interleaved" (a deployment of several stages per device,
        deploy(virtual_stages=v): each device runs its stages' actions in interleaved 1F1B's order, the bubble
        divided by v); torch.distributed.pipelining's names ("GPipe", "1F1B", "Interleaved1F1B", "ZBH1") and
        schedule classes are taken too. It runs on the same Links as the loop; no call is opened per step.

        The loss is computed on the last stage: `loss_fn(output, y)` on the model's (first) output, with a
        torch.nn loss by name ("MSELoss"), class or instance from the allow-list, or a loss module or function of
        your own (F.cross_entropy, a lambda; captured like a layer); or, for a model that computes its loss
        itself (logits, loss = model(idx, targets)), the output that `loss_output` names: its index in the
        model's tuple or its key in the dict (0 for a model that returns only its loss), with no y.
        Mean-reducing losses (the model's own is taken as a mean over the rows) weigh each micro-batch by its
        share of the batch, so the result equals one full-batch step. clip_grad_norm: clip the gradients by their
        global norm before the step, as clip_grad_norm_ does (the optimizer step then waits for the stages'
        norms; model.grad_norm() gives the total norm).
        """
        return self._planned_steps.train_step(x, y, loss_fn, microbatches, schedule, clip_grad_norm, loss_output)

    def fit(self, data, epochs: int = 1, loss_fn="MSELoss", *, microbatches: int | None = None,
            schedule: str = "1f1b", loop: bool = False, loss_output=None, validation=None,
            checkpoint_every: int | None = None, checkpoint_dir=None, callbacks=(), progress=True) -> History:
        """Trains for `epochs` passes over `data` (an iterable of (x, y) batches that can be iterated again, such
        as a DataLoader or a list; x alone with `loss_output`; or a DataSource, whose batches the stages read from
        storage themselves) and returns the History of every step's loss.

        Each batch is one train_step (`microbatches`, `schedule`, `loss_fn` or `loss_output` as train_step takes
        them), or with loop=True model(x), backward and step, as a hand-written loop. `validation`: batches whose
        mean loss is taken after each epoch, in eval mode under torch.no_grad(). `checkpoint_every` N steps,
        save_checkpoint into `checkpoint_dir`/step-N. `callbacks`: functions of (history, step record) called
        after each step; one returning True stops the fit there. `progress`: a tqdm bar with the loss and samples
        per second (a widget in Jupyter), False for none, or a text stream to write it to. Ctrl-C stops after the
        step under way, the model intact (a second Ctrl-C at once); the history says it was interrupted."""
        self._check_open()
        run = Fit(self, loss_fn, loss_output, microbatches, schedule, loop, checkpoint_every, checkpoint_dir,
                  list(callbacks))
        return run.run(data, epochs, validation, progress)

    # -- what the deployment reports -------------------------------------------------------------
    def describe(self) -> Table:
        """Each stage's shard's own report (ShardReport), in stage order: address, device, stage, layers,
        parameters, steps in flight, whether it flushes denormals; prints as a table."""
        return Table(ShardReport.from_message(answer) for answer in self._io.run(self._clients.describe()))

    @property
    def replicas(self) -> int:
        """How many copies of the pipeline train together (data parallel)."""
        return len(self._trainer.replicas)

    def grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm of the last train_step that clipped (None before one did), once it settled."""
        self._check_open()
        self._io.run(self._synchronize())
        return self._trainer.grad_norm

    def stats(self) -> list[dict]:
        """Per shard, what it did in the last train_step: compute seconds, busy fraction, peak activations.
        Waits for that step to settle on every stage."""
        self._check_open()
        self._io.run(self._synchronize())
        return list(self._trainer.stats)

    @property
    def loss_scaler(self) -> LossScaler | None:
        """Under precision="fp16", the dynamic loss scaling (its `scale`, and how many steps it `skipped` because a
        gradient overflowed); None otherwise."""
        return self._trainer.scaler

    @loss_scaler.setter
    def loss_scaler(self, scaler: LossScaler | None) -> None:
        self._trainer.scaler = scaler

    def memory(self) -> list[dict]:
        """Per stage of every replica, the bytes its shard holds: "weights" (and buffers), "gradients" and
        "optimizer" state as they are now, "peak_activations" (the most autograd held for the micro-batches in
        flight, since deploy) and "peak_process" (the shard process's peak resident set, or on a GPU the most its
        CUDA allocator held). Waits for the calls in flight to settle."""
        self._check_open()
        return self._io.run(_memory(self))

    def timeline(self) -> Timeline:
        """What each stage did when in the last train_step (forwards, backwards, the all-reduce, the optimizer
        step) on one time axis; print it for a picture of the pipeline and its bubble. Waits for that step to
        settle on every stage."""
        self._check_open()
        self._io.run(self._synchronize())
        return self._trainer.timeline

    # -- the explicit asynchronous API ---------------------------------------------------------
    async def aforward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the model; returns a leaf tensor that requires grad. Pass its .grad to abackward."""
        return await self._script_loop.aforward(x)

    async def abackward(self, grad_output: torch.Tensor, step: int | None = None) -> None:
        """Backpropagates the gradient of an aforward output (the oldest one not yet backpropagated)."""
        await self._script_loop.abackward(grad_output, step)

    async def astep(self) -> None:
        """Applies every shard's optimizer and waits until all have."""
        await self._script_loop.astep()

    async def azero_grad(self) -> None:
        """Awaitable zero_grad() (it sends nothing by itself either)."""
        self.zero_grad()

    async def astate_dict(self) -> dict[str, torch.Tensor]:
        """Awaitable state_dict()."""
        return await self._io.wrap(self._model_state.read_state())

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


async def _memory(model: DistributedModel) -> list[dict]:
    """model.memory(): every stage's Describe(memory=True), once the calls in flight settled."""
    await model._synchronize()
    stages = [(replica, stage) for replica, clients in enumerate(model._trainer.replicas) for stage in clients.stages]
    answers = await asyncio.gather(*(stage.call("Describe", shard_pb2.DescribeRequest(memory=True))
                                     for _, stage in stages))
    return [{"stage": answer.stage, "replica": replica, "shard": stage.address,
             "weights": answer.memory.weight_bytes, "gradients": answer.memory.gradient_bytes,
             "optimizer": answer.memory.optimizer_bytes, "peak_activations": answer.memory.peak_activation_bytes,
             "peak_process": answer.memory.peak_process_bytes}
            for (replica, stage), answer in zip(stages, answers)]


async def _close(model: DistributedModel) -> None:
    """model.close(): the calls in flight settle (a failure only logged), then every replica's channels close."""
    try:
        await model._synchronize()
    except Exception as error:  # closing must not fail: a broken shard was already reported or is moot now
        log.warning("deployment %s: calls still in flight at close failed: %s", model.deployment_id, error)
    finally:
        await asyncio.gather(*(clients.close() for clients in model._trainer.replicas))
