"""A deployed model that looks like a local one: call it, backpropagate into it, step it."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from client_sdk import recovery
from client_sdk.autograd import RemoteStages
from client_sdk.batch import MAIN, TARGET, Batch
from client_sdk.fit import Fit, History
from client_sdk.gradients import RemoteGradient, RemoteGradients
from client_sdk.inflight import InFlight
from client_sdk.interface import Interface
from client_sdk.io_loop import IoLoop
from client_sdk.loss_scaling import LossScaler
from client_sdk.losses import LossSpecs
from client_sdk.optimizer import Hyperparameters, clip_coefficient, client_optimizer
from client_sdk.data import RowBatch
from client_sdk.pipeline import PipelineTrainer
from client_sdk.reports import ShardReport, Table
from client_sdk.timeline import Timeline
from client_sdk.transport import split_state
from shardtrain import checkpoint, checkpoint_store, optim
from shardtrain import schedule as schedules
from shardtrain.errors import FailedPrecondition, InternalError, InvalidArgument, RolledBack, ShardtrainError
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.sdk")

MAX_AWAITING = 64  # forwards whose backward may still come: as many steps as a shard keeps in flight
MAX_RECOVERIES = 3  # dead shards replaced within one train_step call before its failure is raised


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
        self._io = io
        self._trainer = trainer
        self._clients = trainer.replicas[0]  # the PyTorch-shaped loop drives replica 0 (the only one then)
        self._loss_specs = LossSpecs(self._predict)
        self.placements = list(placements)
        self.virtual_stages = 1  # stages per device (deploy(virtual_stages=)), for the interleaved schedule
        self._owners = owners
        self._holders = holders or dict(owners)  # a tied weight: several stages
        self._gradients = RemoteGradients(
            {p.name: list(p.stages) for p in parameters if p.requires_grad and p.stages}, self._parameter_norms,
            lambda: self._trainer.scaler.scale if self._trainer.scaler is not None else 1.0,
            lambda: self._has_gradients)
        self._parameters = [replace(parameter, gradients=self._gradients) for parameter in parameters]
        self._interface = interface or Interface()  # the model's arguments and outputs
        self._key_order = list(key_order)
        self._parameter_keys = [key for key in parameter_keys if key in owners]  # the order torch.optim numbers
        # The shards' optimizer as seen from here: its param groups hold the hyperparameters in force.
        self.optimizer = client_optimizer(optimizer or shard_pb2.OptimizerSpec(name="SGD", kwargs_json='{"lr": 0.01}'),
                                          self.step, self.zero_grad)
        self._hyperparameters = Hyperparameters(self.optimizer)
        self._gradient_scale = 0.0  # set by clip_grad_norm_ for the next step
        self._anchor = torch.zeros((), requires_grad=True)
        self._steps = itertools.count()
        self._last_step = -1
        self._optimizer_steps = 0
        self._settle_before_forward = 0  # the last optimizer step sent, which the next forward must follow
        self._backward_steps: list[int] = []
        self._zero_grad_pending = False
        # The call-order state a script's calls move through (docs/architecture.md, "Call orders"):
        self._awaiting_backward: list[int] = []  # forwards under autograd whose backward has not been sent
        self._stale: dict[int, str] = {}  # forwards a backward may no longer run for, and why
        self._has_gradients = False  # some backward was sent since the last zero_grad
        self._async_steps: list[int] = []
        self._inflight = InFlight(on_failure=self._abandon_deferred_work)
        self._closed = False
        # train_step survives a dead shard (client_sdk/recovery.py): the cluster's redeploy, and, with replicas, the
        # calls whose optimizer step may not have been applied yet (numbered by it), to run again once restored.
        self._redeploy: recovery.Redeploy | None = None
        self._recent: list[tuple[int, tuple]] = []
        self._refused: set[int] = set()  # optimizer steps sent by calls that raised: no recovery runs them again
        self.recoveries: list[recovery.Recovery] = []  # the dead shards replaced so far, and what it took
        # Without replicas: every snapshot_every train_step calls each stage snapshots itself (client_sdk/recovery.py).
        self.snapshot_every = 0
        self.steps_done = 0  # train_step calls whose step the model holds (after a roll-back, the snapshot's)
        self._periodic: recovery.Periodic | None = None
        self.training = True  # as nn.Module's: train() and eval() set it; every forward says which graphs run
        self.batch_norms = False  # the model has batch norms: train_step with micro-batches warns once
        self.deploy_seconds: dict[str, float] = {}  # where the deploy's time went, by phase

    @property
    def deployment_id(self) -> str:
        """The coordinator's id for this deployment."""
        return self._clients.deployment_id

    # -- the PyTorch-shaped synchronous API ---------------------------------------------------
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

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Runs the model on its arguments, as the local model takes them (the tensors the example had); returns
        what it returns (a tensor, or a tuple or dict of them). Under autograd the result backpropagates into the
        shards: into the first input too when it requires grad; the other inputs take no gradient."""
        x, inputs = self._interface.bind(args, kwargs)
        if torch.is_grad_enabled():
            self._check_single_replica()
            result = RemoteStages.apply(self, self._anchor, x, inputs)
            main, extras = (result[0], result[1:]) if self._interface.outputs else (result, ())
        else:
            main, extras = self._io.run(self._forward(self._begin_step(), x, requires_grad=False, inputs=inputs))
        return self._interface.build(main, extras)

    def step(self) -> None:
        """Every shard applies its optimizer to the gradients accumulated so far (nothing, as in PyTorch, when no
        backward ran since the last zero_grad). Outputs not yet backpropagated can no longer be: their graphs hold
        weights the step changed, and their backward raises FailedPrecondition at once, as PyTorch raises."""
        self._check_open()
        self._io.run(self._step())

    def zero_grad(self) -> None:
        """Clears gradients on every shard (to None, as torch does); sent with the next forward, backward or step
        rather than on its own, so it takes effect before any backward called after it."""
        self._zero_grad_pending = True
        self._has_gradients = False
        self._gradient_scale = 0.0
        self._gradients.take_edits()  # edits of gradients that are gone
        self._gradients.changed()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every stage's gradients: returns their total norm, and the next step()
        scales every gradient by max_norm / (total + 1e-6) when that is under 1. Waits for the backwards sent."""
        self._check_open()
        return self._io.run(self._clip_grad_norm(float(max_norm), float(norm_type), error_if_nonfinite))

    def synchronize(self) -> None:
        """Waits until every shard has finished everything sent so far; raises the first error."""
        self._io.run(self._synchronize())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights, gathered from the shards, in the original model's key order."""
        self._check_open()
        return self._io.run(self._read_state())

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Pushes weights to the shards that own them."""
        self._check_open()
        left_out = set(self._owners) - set(self._key_order)  # by state_dict() too: non-persistent buffers
        per_stage = split_state(state, self._owners, len(self.placements), strict, left_out)
        self._io.run(self._load_state(per_stage))

    def optimizer_state_dict(self) -> dict:
        """The shards' optimizer state (Adam's moments, step counts, hyperparameters...) as torch.optim's
        state_dict() of one optimizer over net.parameters() would hold it. Save it with model.state_dict() to
        resume training exactly; it loads into a local optimizer over the same model too."""
        self._check_open()
        return self._io.run(self._read_optimizer_state())

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Replaces the shards' optimizer state with one from optimizer_state_dict() (or from a local optimizer
        of the same class over net.parameters()); a state that does not fit is refused and changes nothing."""
        self._check_open()
        per_stage = optim.split(optim.from_torch(state, self._parameter_keys), self._holders, len(self.placements))
        self._io.run(self._load_optimizer_state(per_stage))
        self._hyperparameters.loaded(state["param_groups"])

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
        self._check_open()
        target = self._io.run(self._checkpoint_target(directory, on_shards))
        if target is not None:
            self._io.run(self._save_on_shards(target))
            return
        state = optim.from_torch(self.optimizer_state_dict(), self._parameter_keys)
        checkpoint.save(directory, self.state_dict(), state, self._parameter_keys)

    def load_weights(self, source: str | os.PathLike, provided: Sequence[str] = ()) -> dict[str, int]:
        """Has every stage read its own weights from `source`, where they lie: a safetensors file, a directory,
        a Hugging Face sharded checkpoint (model.safetensors.index.json and its files), on a disk the shards see
        or an s3:// URL, under their --data-root; nothing passes through this process. A directory that
        save_checkpoint wrote loads as load_checkpoint(source, optimizer=False) does. Every stage checks every
        tensor (present under its key or a tied weight's, same dtype and shape) before any stage reads one: a
        source that does not fit is refused, naming the tensor, and changes nothing. What state_dict() leaves out
        (non-persistent buffers), and `provided` keys, are not looked for. Returns the bytes each shard read."""
        self._check_open()
        source = os.fspath(source)
        if "://" not in source:
            source = os.path.abspath(source)
            if os.path.exists(os.path.join(source, checkpoint.DESCRIPTION)):
                self.load_checkpoint(source, optimizer=False)
                return {}
        provided = sorted({*provided, *(set(self._owners) - set(self._key_order))})
        answers = self._io.run(self._load_weights(source, provided))
        read = {stage.address: answer.bytes for stage, answer in answers}
        log.info("the shards read %d bytes of weights from %s: %s", sum(read.values()), source, read)
        return read

    async def _load_weights(self, source: str, provided: list[str]) -> list:
        """Every stage of every replica checks its tensors in `source`, then reads them."""
        await self._synchronize()
        self._periodic = None
        stages = [(clients.deployment_id, stage) for clients in self._trainer.replicas for stage in clients.stages]
        answers = []
        for check_only in (True, False):
            answers = await asyncio.gather(*(stage.call("LoadWeights", shard_pb2.LoadWeightsRequest(
                deployment_id=deployment, source=source, provided=provided, check_only=check_only))
                for deployment, stage in stages))
        return [(stage, answer) for (_, stage), answer in zip(stages, answers)]

    def load_checkpoint(self, directory: str | os.PathLike, optimizer: bool = True,
                        on_shards: bool | None = None) -> None:
        """Loads a checkpoint that save_checkpoint wrote, on this split or another, with the optimizer state unless
        `optimizer` is False; a checkpoint that does not fit the model, whose parts are of different saves or
        steps (DataLoss, naming the stage), or whose directory holds a save that did not finish
        (FailedPrecondition) is refused and changes nothing. The shards read their own tensors where they can, as
        save_checkpoint writes them (`on_shards` as there)."""
        self._check_open()
        target = self._io.run(self._checkpoint_target(directory, on_shards))
        if target is not None and (on_shards or checkpoint.readable_by_shards(directory)):
            self._io.run(self._load_on_shards(target, optimizer))
            return
        weights, optimizer_state = checkpoint.load(directory)
        self.load_state_dict(weights)
        if optimizer:
            self.load_optimizer_state_dict(optimizer_state)

    def named_parameters(self):
        """(name, RemoteParameter) for each parameter, in net.named_parameters()'s order (a tied weight once)."""
        return ((parameter.name, parameter) for parameter in self._parameters)

    def parameters(self):
        """Each RemoteParameter, in net.parameters()'s order: sum(p.numel() for p in model.parameters()) counts
        the model's weights, as for a local module."""
        return iter(self._parameters)

    def describe(self) -> Table:
        """Each stage's shard's own report (ShardReport), in stage order: address, device, stage, layers,
        parameters, steps in flight, whether it flushes denormals; prints as a table."""
        return Table(ShardReport.from_message(answer) for answer in self._io.run(self._clients.describe()))

    @property
    def replicas(self) -> int:
        """How many copies of the pipeline train together (data parallel)."""
        return len(self._trainer.replicas)

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
        self._check_open()
        if isinstance(x, RowBatch):
            batch = self._rows_batch(x, y, loss_output)
        else:
            main, inputs = self._interface.bind(*_arguments(x))
            if loss_output is None and y is None:
                raise InvalidArgument("train_step needs the target y of loss_fn, or loss_output= naming the model's "
                                      "output that is its own loss")
            if loss_output is not None and y is not None:
                raise InvalidArgument("with loss_output the model computes its loss itself: pass its targets among "
                                      "its inputs (x), not as y")
            batch = Batch(main, inputs, y)
        schedule = schedules.canonical(schedule)
        self._check_schedule(schedule, microbatches)
        if self.batch_norms and self.training and microbatches > 1:
            self.batch_norms = False  # once
            warnings.warn(f"the model has BatchNorm layers: with microbatches={microbatches} each micro-batch is "
                          "normalised with its own statistics (the running statistics advance as for the whole "
                          "batch), so a step differs from one full-batch step", stacklevel=2)
        clip = None if clip_grad_norm is None else (float(clip_grad_norm), 2.0)
        call = (batch, loss_fn, loss_output, microbatches, schedule, clip, self._hyperparameters.all())
        return self._io.run(self._train_step_surviving(call))

    def _rows_batch(self, rows: RowBatch, y, loss_output) -> Batch:
        """The planned step's batch for a DataSource's rows: each stage reads its share of them itself."""
        source = rows.source
        if y is not None:
            raise InvalidArgument("a DataSource's batch carries its target (DataSource(target=...)): pass no y")
        if loss_output is None and source.target is None:
            raise InvalidArgument("this DataSource has no target field: give it target=, or name the model's own "
                                  "loss output with loss_output=")
        if loss_output is not None and source.target is not None:
            raise InvalidArgument("with loss_output the model computes its loss itself: its DataSource takes "
                                  "target=None and the targets among its inputs")
        args, kwargs, fields = rows.placeholders()
        main, inputs = self._interface.bind(args, kwargs)
        named = {MAIN: fields[id(main)], **{name: fields[id(tensor)] for name, tensor in inputs.items()}}
        if source.target is not None:
            named[TARGET] = source.target
        return Batch(rows.rows, {name: rows.rows for name in inputs}, rows.rows if source.target else None,
                     source, named)

    def _check_schedule(self, schedule: str, microbatches: int) -> None:
        """InvalidArgument, before anything is sent, for a schedule that cannot order this deployment's stages."""
        if schedule in schedules.INTERLEAVED and self.virtual_stages < 2:
            raise InvalidArgument(f"the {schedule} schedule needs several stages per device: "
                                  "deploy(..., virtual_stages=2) on shards serving that many each")
        stages = len({placement.stage for placement in self.placements})
        per_device = self.virtual_stages if schedule in schedules.INTERLEAVED else 1
        if schedule in schedules.SCHEDULES and isinstance(microbatches, int) and not isinstance(microbatches, bool) \
                and 1 <= microbatches <= schedules.MAX_MICROBATCHES:  # else the trainer says what is wrong
            schedules.device_actions(schedule, 0, stages, microbatches, per_device)

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
        step under way, with the model and its optimizer state intact; the history says it was interrupted."""
        self._check_open()
        run = Fit(self, loss_fn, loss_output, microbatches, schedule, loop, checkpoint_every, checkpoint_dir,
                  list(callbacks))
        return run.run(data, epochs, validation, progress)

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
        return self._io.run(self._memory())

    async def _memory(self) -> list[dict]:
        await self._synchronize()
        stages = [(replica, stage) for replica, clients in enumerate(self._trainer.replicas)
                  for stage in clients.stages]
        answers = await asyncio.gather(*(stage.call("Describe", shard_pb2.DescribeRequest(memory=True))
                                         for _, stage in stages))
        return [{"stage": answer.stage, "replica": replica, "shard": stage.address,
                 "weights": answer.memory.weight_bytes, "gradients": answer.memory.gradient_bytes,
                 "optimizer": answer.memory.optimizer_bytes, "peak_activations": answer.memory.peak_activation_bytes,
                 "peak_process": answer.memory.peak_process_bytes}
                for (replica, stage), answer in zip(stages, answers)]

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
        self._check_plain("aforward")
        step = self._begin_step()
        output, _ = await self._io.wrap(self._forward(step, x, requires_grad=True))
        self._async_steps.append(step)
        return output.requires_grad_(True)

    async def abackward(self, grad_output: torch.Tensor, step: int | None = None) -> None:
        """Backpropagates the gradient of an aforward output (the oldest one not yet backpropagated)."""
        if step is None:
            if not self._async_steps:
                raise FailedPrecondition("abackward without a pending aforward")
            step = self._async_steps.pop(0)
        await self._io.wrap(self._backward(step, grad_output, wait=True))

    async def astep(self) -> None:
        """Applies every shard's optimizer and waits until all have."""
        await self._io.wrap(self._step(wait=True))

    async def azero_grad(self) -> None:
        """Awaitable zero_grad() (it sends nothing by itself either)."""
        self.zero_grad()

    async def astate_dict(self) -> dict[str, torch.Tensor]:
        """Awaitable state_dict()."""
        return await self._io.wrap(self._read_state())

    # -- plumbing (coroutines run on the IoLoop) ---------------------------------------------
    async def _train_step_surviving(self, call: tuple) -> float:
        """Runs train_step's `call`. When a shard died, a spare takes its place: with replicas, its stage is restored
        from a live replica and the steps the restored state lacks run again, this one last; without, with
        snapshot_every, every stage goes back to the last snapshots and RolledBack is raised."""
        pending, recoveries = [call], 0
        if self.snapshot_every and self.replicas == 1 and self._periodic is None:  # the state to go back to
            await self._synchronize()
            self._periodic = await recovery.take_snapshots(self._clients, self.steps_done)
        while True:
            number = self._optimizer_steps + 1  # the optimizer step it is about to be
            self._recent = [entry for entry in self._recent if entry[0] < number][-1:] + [(number, pending[0])]
            try:
                loss = await self._train_step(*pending[0][:-1], hyperparameters=pending[0][-1] if recoveries else None)
            except ShardtrainError as error:
                try:
                    recovered = None
                    if self._redeploy is not None and self.replicas > 1 and recoveries < MAX_RECOVERIES:
                        recovered = await recovery.recover(self._trainer.replicas, self._layers_per_stage(),
                                                           self._redeploy)
                    elif self._redeploy is not None and self._periodic is not None:
                        await self._roll_back(error)
                    if recovered is None:
                        raise error  # every shard answers: the failure was not a dead shard
                except RolledBack:
                    raise
                except ShardtrainError:
                    self._recent.pop()  # the call fails: a later recovery does not run it again
                    if self._optimizer_steps >= number:
                        self._refused = {n for n in self._refused if n > number - MAX_AWAITING} | {number}
                    raise
                restored, handle, record = recovered
                await self._adopt(handle)
                lost = [entry for entry in self._recent if entry[0] > restored]
                first = restored + 1
                while first in self._refused:  # optimizer steps the shards refused: nothing to run again
                    first += 1
                self._recent, self._refused = [], set()
                if lost and lost[0][0] != first:
                    raise FailedPrecondition(f"a dead shard was replaced and the model restored at optimizer step "
                                             f"{restored}, but step {first} is no longer kept to run again: load a "
                                             "checkpoint, or go on from here") from error
                recoveries += 1
                self.recoveries.append(dataclasses.replace(record, steps_run_again=len(lost)))
                self.steps_done -= sum(1 for entry in lost if entry[1] is not pending[0])  # counted when they ran
                if not lost:  # this call's step was applied everywhere; its loss died with the shard
                    log.warning("a dead shard was replaced after its step was applied; that step's loss is lost")
                    pending.pop(0)
                    if not pending:
                        return math.nan
                pending = [entry[1] for entry in lost] + pending[1:]
                continue
            pending.pop(0)
            self.steps_done += 1
            if self.snapshot_every and self._periodic is not None and self.steps_done % self.snapshot_every == 0:
                await self._synchronize()  # every stage at the same step
                self._periodic = await recovery.take_snapshots(self._clients, self.steps_done)
            if not pending:
                return loss

    def _layers_per_stage(self) -> list[int]:
        return [placement.end_layer - placement.first_layer for placement in self.placements]

    async def _roll_back(self, error: ShardtrainError) -> None:
        """A shard of a deployment without replicas died: a spare takes its place, every stage goes back to the last
        snapshots, and RolledBack says from which step to train again. Raises `error` if every shard answers."""
        rolled = await recovery.roll_back(self._clients, self._periodic, self._layers_per_stage(), self._redeploy)
        if rolled is None:
            raise error
        handle, record = rolled
        await self._adopt(handle)
        self._recent, self._refused = [], set()
        self.recoveries.append(dataclasses.replace(record, steps_run_again=self.steps_done - self._periodic.steps_done))
        self.steps_done = self._periodic.steps_done
        self._periodic = await recovery.take_snapshots(self._clients, self.steps_done)  # the spare holds none yet
        raise RolledBack(f"{', '.join(record.dead)} died; {', '.join(record.replaced_by)} took its place and the "
                         f"model went back to its snapshot after train_step call {self.steps_done} "
                         f"(model.steps_done): train again on the batches after it", self.steps_done) from error

    async def _adopt(self, other: DistributedModel) -> None:
        """Takes over `other`'s deployment (a redeploy of the same model with the same split): this handle, its
        optimizer and its hyperparameters stay the user's."""
        old = self._trainer.replicas
        self._inflight.abandon()  # the old deployment's calls: failed, or never to finish
        for name in ("_trainer", "_clients", "placements", "_steps", "_last_step", "_optimizer_steps",
                     "_settle_before_forward", "_backward_steps", "_zero_grad_pending", "_awaiting_backward", "_stale",
                     "_has_gradients", "_async_steps", "_inflight"):
            setattr(self, name, getattr(other, name))
        other._closed = True
        await asyncio.gather(*(clients.close() for clients in old), return_exceptions=True)

    async def _train_step(self, batch: Batch, loss_fn, loss_output, microbatches: int, schedule: str,
                          clip=None, hyperparameters: str | None = None) -> float:
        self._inflight.raise_failures()
        if self._backward_steps:
            await self._synchronize()  # a loop backward still running would add to the step's fresh gradients
        if loss_output is not None:
            spec = shard_pb2.LossSpec(model_output=self._interface.output_name(loss_output))
        else:
            spec = await self._loss_specs(loss_fn, batch)
        # One step ahead of the shards at most, as the loop. No output confirms a loop step before this one: ask.
        await self._clients.flush(wait=False)
        await self._inflight.drain_previous()
        # A planned step starts from zero gradients: a pending zero_grad, and edits of the old ones, are moot.
        self._zero_grad_pending = False
        self._gradients.take_edits()
        self._gradients.changed()
        self._outdate_awaiting_backward()
        self._has_gradients = True  # as after a step in one process: the step's gradients stay
        step, after = self._begin_step(), self._settle_before_forward
        self._optimizer_steps += 1
        self._settle_before_forward = self._optimizer_steps
        try:
            loss, settled = await self._trainer.run(step, batch, spec, microbatches, schedule, after,
                                                    self._optimizer_steps, eval_mode=not self.training,
                                                    hyperparameters=self._hyperparameters.changes()
                                                    if hyperparameters is None else hyperparameters, clip=clip)
            self.optimizer._opt_called = True  # what torch's lr schedulers check: an optimizer step ran
        except BaseException:
            self._abandon_deferred_work()
            raise
        self._inflight.add(settled)
        self._inflight.next_iteration()
        return loss

    async def _predict(self, x: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's (first) output for its inputs, without autograd (an example for capturing a loss), in eval
        mode: it must not move a BatchNorm's running statistics."""
        return (await self._forward(self._begin_step(), x, requires_grad=False, training=False, inputs=inputs))[0]

    def _check_plain(self, what: str) -> None:
        if not self._interface.is_plain:
            raise FailedPrecondition(f"{what} takes models of one tensor in and one out; this one takes "
                                     f"{list(self._interface.inputs)} and returns {1 + len(self._interface.outputs)} "
                                     "tensors: train it with the loop (outputs = model(...); loss.backward(); "
                                     "model.step()) or with model.train_step")

    def _check_single_replica(self) -> None:
        if self.replicas > 1:
            raise FailedPrecondition(f"this deployment has {self.replicas} replicas: train it with "
                                     "model.train_step(x, y, loss_fn, ...), which keeps them in step; "
                                     "model(x) under torch.no_grad() still runs inference on replica 0")

    def _begin_step(self) -> int:
        self._check_open()
        self._last_step = next(self._steps)
        return self._last_step

    def _remote_forward(self, step: int, x: torch.Tensor, inputs: dict[str, torch.Tensor], requires_grad: bool,
                        input_requires_grad: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self._io.run(self._forward(step, x, requires_grad, input_requires_grad, inputs=inputs))

    def _remote_backward(self, step: int, grad_output: torch.Tensor, input_requires_grad: bool = False,
                         output_grads: dict[str, torch.Tensor | None] | None = None) -> torch.Tensor | None:
        return self._io.run(self._backward(step, grad_output, wait=input_requires_grad, output_grads=output_grads))

    async def _forward(self, step: int, x: torch.Tensor, requires_grad: bool, input_requires_grad: bool = False,
                       training: bool | None = None,
                       inputs: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the main output, the model's other outputs in the interface's order)."""
        self._inflight.raise_failures()
        zero_grad, self._zero_grad_pending = self._zero_grad_pending, False
        training = self.training if training is None else training
        if requires_grad:
            self._await_backward(step)
        output, extras = await self._clients.forward(step, x.detach(), requires_grad, zero_grad,
                                                     self._settle_before_forward, input_requires_grad,
                                                     eval_mode=not training, inputs=inputs)
        missing = [name for name in self._interface.outputs if name not in extras]
        if missing:
            raise InternalError(f"step {step}: the last stage sent no output {missing}")
        return output, [extras[name] for name in self._interface.outputs]

    async def _backward(self, step: int, grad_output: torch.Tensor | None, wait: bool,
                        output_grads: dict[str, torch.Tensor | None] | None = None) -> torch.Tensor | None:
        """Sends a backward; with `wait`, waits for it and returns the input's gradient (if the forward asked)."""
        self._inflight.raise_failures()
        self._check_backward(step)
        zero_grad, self._zero_grad_pending = self._zero_grad_pending, False
        self._has_gradients = True
        self._gradients.changed()
        scaler = self._trainer.scaler
        if scaler is not None:  # fp16: the shards' backward runs on the loss scaled up (loss_scaling.py)
            grad_output = grad_output * scaler.scale if grad_output is not None else None
            if output_grads:
                output_grads = {name: grad * scaler.scale if grad is not None else None
                                for name, grad in output_grads.items()}
        call = asyncio.ensure_future(self._clients.backward(step, grad_output, zero_grad, output_grads))
        self._backward_steps.append(step)
        self._inflight.add(call)
        if not wait:
            return None
        grad_input = await call
        return grad_input / scaler.scale if scaler is not None and grad_input is not None else grad_input

    async def _step(self, wait: bool = False) -> None:
        """Sends the optimizer step down the stages at once; each applies it after its own backwards."""
        if not self._has_gradients:  # torch.optim skips parameters without gradients: this step changes nothing
            self._gradients.take_edits()
            if wait:
                await self._synchronize()
            return
        self._outdate_awaiting_backward()
        await self._clients.flush()  # the previous step is confirmed by now, unless no forward came between
        await self._inflight.drain_previous()
        zero_grad, self._zero_grad_pending = self._zero_grad_pending, False
        unscale, skip = await self._loss_scaling()
        self._optimizer_steps += 1
        backward_steps, self._backward_steps = self._backward_steps, []
        request = self._clients.step_request(self._last_step, zero_grad, self._optimizer_steps, backward_steps)
        request.hyperparameters_json = self._hyperparameters.changes()
        request.gradient_scale, self._gradient_scale = (self._gradient_scale or 1.0) * unscale if unscale else \
            self._gradient_scale, 0.0
        request.skip = skip
        request.gradient_edits.extend(self._gradients.take_edits())
        self._gradients.changed()
        self._settle_before_forward = request.optimizer_step
        self._inflight.add(self._clients.step(request))
        self._inflight.next_iteration()
        if wait:
            await self._synchronize()

    async def _loss_scaling(self) -> tuple[float, bool]:
        """Under fp16's loss scaling: (the factor that unscales the gradients, whether a gradient overflowed and
        the step is skipped), from the stages' gradient norms; (0, False) without it."""
        scaler = self._trainer.scaler
        if scaler is None:
            return 0.0, False
        norms = await self._clients.gradient_norms(self._backward_steps, 2.0, self._optimizer_steps + 1,
                                                   self._gradients.take_edits_by_stage())
        unscale, skip, _ = scaler.verdict(norms)
        return unscale, skip

    async def _clip_grad_norm(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        self._inflight.raise_failures()
        if not self._has_gradients:
            return torch.tensor(0.0)
        norms = await self._clients.gradient_norms(self._backward_steps, norm_type, self._optimizer_steps + 1,
                                                   self._gradients.take_edits_by_stage())
        if self._trainer.scaler is not None:  # the gradients are the scaled loss's
            norms = [norm / self._trainer.scaler.scale for norm in norms]
        total, self._gradient_scale = clip_coefficient(norms, max_norm, norm_type, error_if_nonfinite)
        return total

    def _parameter_norms(self, norm_type: float, edits: dict[int, list], names: dict[int, list[str]]
                         ) -> dict[str, float]:
        """The gradient norm of each named parameter (per stage), once the backwards sent are over, after `edits`."""
        async def fetch() -> dict[str, float]:
            self._inflight.raise_failures()
            answers = await self._clients.gradient_norm_answers(self._backward_steps, norm_type,
                                                                self._optimizer_steps + 1, edits, names)
            return {name: norm for stage, answer in enumerate(answers)
                    for name, norm in zip(names.get(stage, []), answer.parameter_norms)}
        self._check_open()
        return self._io.run(fetch())

    def _await_backward(self, step: int) -> None:
        """Records a forward under autograd; beyond MAX_AWAITING, the oldest one's graph is given up, as the
        shards give it up (they keep as many steps in flight)."""
        self._awaiting_backward.append(step)
        if len(self._awaiting_backward) > MAX_AWAITING:
            self._outdate(self._awaiting_backward.pop(0), f"more than {MAX_AWAITING} later forwards ran before its "
                                                          "backward, and the shards keep no more graphs than that")

    def _check_backward(self, step: int) -> None:
        """FailedPrecondition, at once, for a backward that no shard could run: PyTorch refuses these too."""
        if step in self._stale:
            raise FailedPrecondition(f"step {step}'s output cannot be backpropagated: {self._stale.pop(step)}")
        if step not in self._awaiting_backward:
            raise FailedPrecondition(f"step {step}'s output was already backpropagated, or never ran under autograd: "
                                     "the shards free a forward's graph at its backward (retain_graph is not kept "
                                     "across the wire); run the forward again for another backward")
        self._awaiting_backward.remove(step)

    def _outdate_awaiting_backward(self) -> None:
        """An optimizer step changes the weights that every graph still awaiting its backward holds."""
        for step in self._awaiting_backward:
            self._outdate(step, "an optimizer step changed the weights its graph holds since (PyTorch raises the "
                                "same: a variable needed for gradient computation has been modified by an inplace "
                                "operation); run the forward again")
        self._awaiting_backward.clear()

    def _outdate(self, step: int, why: str) -> None:
        self._stale[step] = why
        while len(self._stale) > MAX_AWAITING:
            self._stale.pop(next(iter(self._stale)))

    def _abandon_deferred_work(self) -> None:
        """After a failure every call in flight was cancelled: no step is owed, none may be waited for."""
        self._settle_before_forward = 0
        self._backward_steps.clear()

    async def _synchronize(self) -> None:
        await self._clients.flush()
        await self._inflight.drain()

    async def _read_state(self) -> dict[str, torch.Tensor]:
        await self._synchronize()
        state = await self._clients.read_state()
        return {key: state[key] for key in self._key_order if key in state}

    async def _read_optimizer_state(self) -> dict:
        await self._synchronize()
        state = optim.indexed(optim.merged(await self._clients.read_optimizer_state()), self._parameter_keys)
        self._hyperparameters.overlay(state["param_groups"])
        return state

    async def _checkpoint_target(self, directory, on_shards: bool | None) -> str | None:
        """The directory to hand the shards, when they write and read the checkpoint themselves; None when this
        process does."""
        if on_shards is False:
            return None
        roots = {answer.address: answer.checkpoint_dir for answer in await self._clients.describe()}
        relative = on_shards and not os.path.isabs(directory)  # to each shard's own --checkpoint-dir
        target = os.fspath(directory) if relative else os.path.abspath(directory)
        outside = [address for address, root in roots.items()
                   if not root or not (relative or os.path.commonpath([root, target]) == root)]
        if not outside:
            return target
        if on_shards:
            raise FailedPrecondition(f"checkpoint {target!r}: the shard at {outside[0]} writes and reads checkpoints "
                                     f"only under its --checkpoint-dir "
                                     f"({roots[outside[0]] or 'none: it was started without one'})")
        return None

    async def _save_on_shards(self, directory: str) -> None:
        """Every stage writes its part of a new generation at once (replica 0's: the replicas are equal), then
        stage 0 publishes it with checkpoint.json. When any part fails, the others are discarded and the error
        raised: the directory then refuses loads until a save into it succeeds (checkpoint_store.py)."""
        await self._synchronize()
        stages = self._clients.stages
        generation = checkpoint_store.new_generation()

        def request(**fields) -> shard_pb2.SaveCheckpointRequest:
            return shard_pb2.SaveCheckpointRequest(deployment_id=self._clients.deployment_id, directory=directory,
                                                   generation=generation, parts=len(stages), **fields)
        answers = await asyncio.gather(*(stage.call("SaveCheckpoint", request(part=index))
                                         for index, stage in enumerate(stages)), return_exceptions=True)
        try:
            failed = [answer for answer in answers if isinstance(answer, BaseException)]
            if failed:
                raise failed[0]
            await stages[0].call("SaveCheckpoint", request(description=self._description(generation, answers)))
        except BaseException:
            await asyncio.gather(*(stage.call("SaveCheckpoint", request(part=index, discard=True))
                                   for index, stage in enumerate(stages)), return_exceptions=True)
            raise

    def _description(self, generation: str, answers: list[shard_pb2.SaveCheckpointResponse]) -> str:
        """checkpoint.json of save `generation`, whose parts the stages wrote (`answers`) at one optimizer step."""
        steps = [answer.optimizer_step for answer in answers]
        if len(set(steps)) != 1:
            raise InternalError(f"the stages saved at different optimizer steps {steps}, though every step had "
                                "settled")
        return checkpoint.description(len(steps), self._key_order, self._parameter_keys, self._hyperparameters.all(),
                                      generation, steps[0])

    async def _load_on_shards(self, directory: str, optimizer: bool) -> None:
        """Every stage of every replica checks its share, then loads it (a checkpoint one stage refuses changes
        none)."""
        await self._synchronize()
        self._periodic = None
        answers = []
        for check_only in (True, False):
            calls = [stage.call("LoadCheckpoint", shard_pb2.LoadCheckpointRequest(
                deployment_id=clients.deployment_id, directory=directory, optimizer=optimizer, check_only=check_only))
                for clients in self._trainer.replicas for stage in clients.stages]
            answers = await asyncio.gather(*calls)
        if optimizer:
            states = [optim.KeyedState.parse(answer.layout, {}) for answer in answers[:len(self._clients.stages)]]
            self._hyperparameters.loaded(optim.indexed(optim.merged(states), self._parameter_keys)["param_groups"])

    async def _load_optimizer_state(self, per_stage) -> None:
        """Every stage checks its share before any loads it: a state that one stage refuses changes none."""
        await self._synchronize()
        self._periodic = None
        for check_only in (True, False):
            await asyncio.gather(*(clients.load_optimizer_state(per_stage, check_only)
                                   for clients in self._trainer.replicas))

    async def _load_state(self, per_stage) -> None:
        await self._synchronize()
        self._periodic = None  # the snapshots no longer hold this state: the next train_step takes new ones
        await asyncio.gather(*(clients.load_state(per_stage) for clients in self._trainer.replicas))

    async def _close(self) -> None:
        try:
            await self._synchronize()
        except Exception as error:  # closing must not fail: a broken shard was already reported or is moot now
            log.warning("deployment %s: calls still in flight at close failed: %s", self.deployment_id, error)
        finally:
            await asyncio.gather(*(clients.close() for clients in self._trainer.replicas))

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
            self._io.run(self._close())

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition(f"deployment {self.deployment_id} is closed: the cluster was closed or "
                                     "deployed another model; use the handle the latest deploy returned")

    def __repr__(self) -> str:
        stages = ", ".join(f"stage {p.stage}@{p.shard_address}: layers {p.first_layer}-{p.end_layer - 1}"
                           for p in self.placements)
        return f"DistributedModel({self.deployment_id}; {stages})"


def _arguments(x) -> tuple[tuple, dict]:
    """train_step's x as a call's (args, kwargs): a tuple holds the positional arguments, a dict the keywords."""
    if isinstance(x, tuple):
        return x, {}
    if isinstance(x, dict):
        return (), x
    return (x,), {}
