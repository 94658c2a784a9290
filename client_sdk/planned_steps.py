"""model.train_step on the handle's side: the batch bound and checked, one planned step sent on every replica, and
the steps a dead shard cost run again once it was replaced (client_sdk/recovery.py); the handle's train_step and fit
methods."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import warnings
from collections.abc import Callable

import torch

from client_sdk import recovery
from client_sdk.batch import MAIN, TARGET, Batch
from client_sdk.call_order import MAX_AWAITING
from client_sdk.data_source import RowBatch
from client_sdk.fit import Fit, History
from client_sdk.loss_specs import LossSpecs
from shardtrain import schedule as schedules
from shardtrain.errors import FailedPrecondition, InvalidArgument, RolledBack, ShardtrainError
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.sdk")

MAX_RECOVERIES = 3  # dead shards replaced within one train_step call before its failure is raised
# What a handle holds of its deployment, which a redeploy after a dead shard swaps: the handle's loop, planned steps
# and state keep none of it, and reach it through the handle.
DEPLOYMENT_ATTRIBUTES = ("_trainer", "_clients", "placements", "_call_order")


class TrainingMethods:
    """The handle's training methods (DistributedModel inherits them): train_step, passed to the handle's
    PlannedSteps, and fit, epochs of train_steps (or of the loop) run by a Fit."""

    _planned_steps: PlannedSteps
    _check_open: Callable[[], None]  # the handle's: raises once it is closed

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


class PlannedSteps:
    """train_step for the handle `model` (a DistributedModel). It survives a dead shard: with replicas, the calls
    whose optimizer step may not have been applied yet (numbered by it) run again once restored; without, every
    snapshot_every calls each stage snapshots itself, and a death rolls every stage back to the snapshots."""

    def __init__(self, model) -> None:
        self.model = model
        self._loss_specs = LossSpecs(model._script_loop.predict)
        self._recent: list[tuple[int, tuple]] = []
        self._refused: set[int] = set()  # optimizer steps sent by calls that raised: no recovery runs them again
        self._periodic: recovery.Periodic | None = None

    def train_step(self, x, y, loss_fn, microbatches: int, schedule: str, clip_grad_norm: float | None,
                   loss_output) -> float:
        """model.train_step(): see there."""
        model = self.model
        model._check_open()
        if isinstance(x, RowBatch):
            batch = self._rows_batch(x, y, loss_output)
        else:
            main, inputs = model._interface.bind(*_arguments(x))
            if loss_output is None and y is None:
                raise InvalidArgument("train_step needs the target y of loss_fn, or loss_output= naming the model's "
                                      "output that is its own loss")
            if loss_output is not None and y is not None:
                raise InvalidArgument("with loss_output the model computes its loss itself: pass its targets among "
                                      "its inputs (x), not as y")
            batch = Batch(main, inputs, y)
        schedule = schedules.canonical(schedule)
        self.check_schedule(schedule, microbatches)
        if model.batch_norms and model.training and microbatches > 1:
            model.batch_norms = False  # once
            warnings.warn(f"the model has BatchNorm layers: with microbatches={microbatches} each micro-batch is "
                          "normalised with its own statistics (the running statistics advance as for the whole "
                          "batch), so a step differs from one full-batch step", stacklevel=3)
        clip = None if clip_grad_norm is None else (float(clip_grad_norm), 2.0)
        call = (batch, loss_fn, loss_output, microbatches, schedule, clip, model._hyperparameters.all())
        return model._io.run(self._surviving(call))

    def check_schedule(self, schedule: str, microbatches: int) -> None:
        """InvalidArgument, before anything is sent, for a schedule that cannot order this deployment's stages."""
        model = self.model
        if schedule in schedules.INTERLEAVED and model.virtual_stages < 2:
            raise InvalidArgument(f"the {schedule} schedule needs several stages per device: "
                                  "deploy(..., virtual_stages=2) on shards serving that many each")
        stages = len({placement.stage for placement in model.placements})
        per_device = model.virtual_stages if schedule in schedules.INTERLEAVED else 1
        if schedule in schedules.SCHEDULES and isinstance(microbatches, int) and not isinstance(microbatches, bool) \
                and 1 <= microbatches <= schedules.MAX_MICROBATCHES:  # else the trainer says what is wrong
            schedules.device_actions(schedule, 0, stages, microbatches, per_device)

    def forget_snapshots(self) -> None:
        """The stages' state was replaced (a load): the snapshots no longer hold it, the next train_step takes new
        ones."""
        self._periodic = None

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
        main, inputs = self.model._interface.bind(args, kwargs)
        named = {MAIN: fields[id(main)], **{name: fields[id(tensor)] for name, tensor in inputs.items()}}
        if source.target is not None:
            named[TARGET] = source.target
        return Batch(rows.rows, {name: rows.rows for name in inputs}, rows.rows if source.target else None,
                     source, named)

    async def _surviving(self, call: tuple) -> float:
        """Runs train_step's `call`. When a shard died, a spare takes its place: with replicas, its stage is restored
        from a live replica and the steps the restored state lacks run again, this one last; without, with
        snapshot_every, every stage goes back to the last snapshots and RolledBack is raised."""
        model = self.model
        pending, recoveries = [call], 0
        if model.snapshot_every and model.replicas == 1 and self._periodic is None:  # the state to go back to
            await model._synchronize()
            self._periodic = await recovery.take_snapshots(model._clients, model.steps_done)
        while True:
            number = model._call_order.optimizer_steps + 1  # the optimizer step it is about to be
            self._recent = [entry for entry in self._recent if entry[0] < number][-1:] + [(number, pending[0])]
            try:
                loss = await self._run(*pending[0][:-1], hyperparameters=pending[0][-1] if recoveries else None)
            except ShardtrainError as error:
                restored, record = await self._replace_dead_shard(error, number, recoveries)
                lost = self._lost_since(restored, error)
                recoveries += 1
                model.recoveries.append(dataclasses.replace(record, steps_run_again=len(lost)))
                model.steps_done -= sum(1 for entry in lost if entry[1] is not pending[0])  # counted when they ran
                if not lost:  # this call's step was applied everywhere; its loss died with the shard
                    log.warning("a dead shard was replaced after its step was applied; that step's loss is lost")
                    pending.pop(0)
                    if not pending:
                        return math.nan
                pending = [entry[1] for entry in lost] + pending[1:]
                continue
            pending.pop(0)
            model.steps_done += 1
            if model.snapshot_every and self._periodic is not None and model.steps_done % model.snapshot_every == 0:
                await self._snapshot()
            if not pending:
                return loss

    async def _snapshot(self) -> None:
        """Every stage snapshots itself once the steps settled. A shard that died after this call's loss came (its
        step never settles there) sends the model back to the last snapshots, as a death during the call does:
        RolledBack. One that dies while the stages snapshot leaves no whole set (the others replaced theirs): its
        failure is raised, and no later roll-back goes back to a mix of two steps."""
        model = self.model
        try:
            await model._synchronize()  # every stage at the same step
        except ShardtrainError as error:
            if model._redeploy is None:
                raise
            await self._roll_back(error)
        try:
            self._periodic = await recovery.take_snapshots(model._clients, model.steps_done)
        except ShardtrainError as error:
            self._periodic = None
            log.error("deployment %s: the snapshots after train_step call %d were taken only in part (%s): no "
                      "snapshot of the whole model is left to go back to", model.deployment_id, model.steps_done,
                      error)
            raise

    async def _replace_dead_shard(self, error: ShardtrainError, number: int,
                                  recoveries: int) -> tuple[int, recovery.Recovery]:
        """After call `number` failed with `error`: a spare replaces the dead shard, restored from a live replica, and
        the handle takes the new deployment over; returns (the optimizer step restored, what it took). Raises `error`
        when every shard answers (the failure was not a dead shard), RolledBack without replicas."""
        model = self.model
        try:
            recovered = None
            if model._redeploy is not None and model.replicas > 1 and recoveries < MAX_RECOVERIES:
                recovered = await recovery.recover(model._trainer.replicas, self._layers_per_stage(), model._redeploy)
            elif model._redeploy is not None and self._periodic is not None:
                await self._roll_back(error)
            if recovered is None:
                raise error  # every shard answers: the failure was not a dead shard
        except RolledBack:
            raise
        except ShardtrainError:
            self._recent.pop()  # the call fails: a later recovery does not run it again
            if model._call_order.optimizer_steps >= number:
                self._refused = {n for n in self._refused if n > number - MAX_AWAITING} | {number}
            raise
        restored, handle, record = recovered
        await self._adopt(handle)
        return restored, record

    def _lost_since(self, restored: int, error: ShardtrainError) -> list[tuple[int, tuple]]:
        """The calls kept whose optimizer step the state restored at step `restored` lacks, to run again in order;
        FailedPrecondition when the first of them is no longer kept."""
        lost = [entry for entry in self._recent if entry[0] > restored]
        first = restored + 1
        while first in self._refused:  # optimizer steps the shards refused: nothing to run again
            first += 1
        self._recent, self._refused = [], set()
        if lost and lost[0][0] != first:
            raise FailedPrecondition(f"a dead shard was replaced and the model restored at optimizer step "
                                     f"{restored}, but step {first} is no longer kept to run again: load a "
                                     "checkpoint, or go on from here") from error
        return lost

    def _layers_per_stage(self) -> list[int]:
        return [placement.end_layer - placement.first_layer for placement in self.model.placements]

    async def _roll_back(self, error: ShardtrainError) -> None:
        """A shard of a deployment without replicas died: a spare takes its place, every stage goes back to the last
        snapshots, and RolledBack says from which step to train again. Raises `error` if every shard answers."""
        model = self.model
        rolled = await recovery.roll_back(model._clients, self._periodic, self._layers_per_stage(), model._redeploy)
        if rolled is None:
            raise error
        handle, record = rolled
        await self._adopt(handle)
        self._recent, self._refused = [], set()
        model.recoveries.append(dataclasses.replace(record,
                                                    steps_run_again=model.steps_done - self._periodic.steps_done))
        model.steps_done = self._periodic.steps_done
        self._periodic = await recovery.take_snapshots(model._clients, model.steps_done)  # the spare holds none yet
        raise RolledBack(f"{', '.join(record.dead)} died; {', '.join(record.replaced_by)} took its place and the "
                         f"model went back to its snapshot after train_step call {model.steps_done} "
                         f"(model.steps_done): train again on the batches after it", model.steps_done) from error

    async def _adopt(self, other) -> None:
        """Takes over `other`'s deployment (a redeploy of the same model with the same split): the handle, its
        optimizer and its hyperparameters stay the user's, and the next step sends them all (the stages restored
        snapshots, with the hyperparameters of their time)."""
        model = self.model
        old, scaler = model._trainer.replicas, model._trainer.scaler
        model._call_order.inflight.abandon()  # the old deployment's calls: failed, or never to finish
        for name in DEPLOYMENT_ATTRIBUTES:
            setattr(model, name, getattr(other, name))
        model._trainer.scaler = scaler  # fp16's loss scale is the training's, not the deployment's
        model._hyperparameters.restored()
        other._closed = True
        await asyncio.gather(*(clients.close() for clients in old), return_exceptions=True)

    async def _run(self, batch: Batch, loss_fn, loss_output, microbatches: int, schedule: str,
                   clip=None, hyperparameters: str | None = None) -> float:
        """One planned step on `batch` as the next optimizer step; returns its loss once the last stages sent it."""
        model, calls = self.model, self.model._call_order
        calls.inflight.raise_failures()
        if calls.backward_steps:
            await model._synchronize()  # a loop backward still running would add to the step's fresh gradients
        if loss_output is not None:
            spec = shard_pb2.LossSpec(model_output=model._interface.output_name(loss_output))
        else:
            spec = await self._loss_specs(loss_fn, batch)
        # One step ahead of the shards at most, as the loop. No output confirms a loop step before this one: ask,
        # every replica, and wait up to the deadline: a stopped shard never confirms, and recovery replaces it.
        await model._trainer.flush()
        await calls.inflight.drain_previous()
        # A planned step starts from zero gradients: a pending zero_grad, and edits of the old ones, are moot.
        calls.zero_grad_pending = False
        model._gradients.cleared()
        calls.outdate_awaiting_backward()
        calls.has_gradients = True  # as after a step in one process: the step's gradients stay
        step, after = model._script_loop.begin_step(), calls.settle_before_forward
        calls.optimizer_steps += 1
        calls.settle_before_forward = calls.optimizer_steps
        try:
            loss, settled = await model._trainer.run(step, batch, spec, microbatches, schedule, after,
                                                     calls.optimizer_steps, eval_mode=not model.training,
                                                     hyperparameters=model._hyperparameters.changes()
                                                     if hyperparameters is None else hyperparameters, clip=clip)
            model.optimizer._opt_called = True  # what torch's lr schedulers check: an optimizer step ran
        except BaseException:
            calls.abandon_deferred_work()
            raise
        calls.inflight.add(settled)
        calls.inflight.next_iteration()
        return loss


def _arguments(x) -> tuple[tuple, dict]:
    """train_step's x as a call's (args, kwargs): a tuple holds the positional arguments, a dict the keywords."""
    if isinstance(x, tuple):
        return x, {}
    if isinstance(x, dict):
        return (), x
    return (x,), {}
