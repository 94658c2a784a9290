"""model.train_step: a batch split over replicas and micro-batches, run as one planned step on each replica's Links."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from client_sdk.inflight import let_go
from client_sdk.loss_scaling import LossScaler
from client_sdk.optimizer import clip_coefficient
from client_sdk.transport import StageClients
from client_sdk.timeline import Timeline
from shardtrain import schedule as schedules
from shardtrain.errors import InvalidArgument
from shardtrain.v1 import shard_pb2


def split_batch(batch: dict[str, torch.Tensor], replicas: int, microbatches: int) -> list[list[dict]]:
    """Per replica, its micro-batches: every tensor of `batch` (the model's inputs, the target) split by rows, the
    same rows of each together; the last micro-batches may be a row shorter."""
    rows = {name: tensor.shape[0] if tensor.dim() else None for name, tensor in batch.items()}
    if None in rows.values() or len(set(rows.values())) != 1:
        shapes = ", ".join(f"{name} {list(tensor.shape)}" for name, tensor in batch.items())
        raise InvalidArgument(f"the inputs and the target need the same batch dimension (dim 0), got {shapes}")
    if not isinstance(microbatches, int) or not 1 <= microbatches <= schedules.MAX_MICROBATCHES:
        raise InvalidArgument(f"microbatches must be an integer in 1..{schedules.MAX_MICROBATCHES}, "
                              f"got {microbatches!r}")
    count = next(iter(rows.values()))
    if count < replicas * microbatches:
        raise InvalidArgument(f"a batch of {count} rows cannot feed {replicas} replica(s) x {microbatches} "
                              "micro-batches: each needs at least one row")
    pieces = {name: [torch.tensor_split(share, microbatches) for share in torch.tensor_split(tensor, replicas)]
              for name, tensor in batch.items()}
    return [[{name: pieces[name][r][k] for name in batch} for k in range(microbatches)] for r in range(replicas)]


@dataclass(frozen=True)
class Batch:
    """What a planned step trains on: the main input, the model's other inputs by name, the loss's target (None
    when the model computes its loss itself). With a `source` (a DataSource), each of them is the rows of the field
    `fields` names for it, which the stages read themselves."""

    x: torch.Tensor
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    y: torch.Tensor | None = None
    source: object = None  # client_sdk.data.DataSource
    fields: dict[str, str] = field(default_factory=dict)  # MAIN, an input's name or TARGET -> the source's field

    @property
    def rows(self) -> int:
        return self.x.shape[0] if self.x.dim() else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {MAIN: self.x, **self.inputs}
        if self.y is not None:
            named[TARGET] = self.y
        return {name: tensor.detach() for name, tensor in named.items()}

    def piece(self, named: dict[str, torch.Tensor]) -> Batch:
        """The batch of these rows of each tensor (split_batch's pieces)."""
        inputs = {name: tensor for name, tensor in named.items() if name not in (MAIN, TARGET)}
        return Batch(named[MAIN], inputs, named.get(TARGET), self.source, self.fields)

    def data(self, name: str) -> shard_pb2.DataRows | None:
        """The DataRows the stage reads for the tensor `name` (MAIN, an input's, TARGET); None without a source."""
        if self.source is None:
            return None
        rows = self.x if name == MAIN else self.y if name == TARGET else self.inputs[name]
        return self.source.rows_message(self.fields[name], rows)

    def example(self, count: int) -> Batch:
        """The first `count` rows as tensors here (read from the source if there is one)."""
        rows = {name: tensor[:count] for name, tensor in self.tensors().items()}
        if self.source is None:
            return self.piece(rows)
        values = self.source.read(rows[MAIN])
        return Batch(values[self.fields[MAIN]], {name: values[self.fields[name]] for name in self.inputs},
                     values[self.fields[TARGET]] if TARGET in self.fields else None)


MAIN, TARGET = "the first input", "the target"  # how split_batch's errors name them (never an argument's name)


class PipelineTrainer:
    """Runs planned steps over every replica's stages; keeps the last step's figures."""

    def __init__(self, replicas: Sequence[StageClients]):
        self.replicas = list(replicas)
        self.stats: list[dict] = []
        self.timeline = Timeline(())
        self.grad_norm: torch.Tensor | None = None  # the last clipped step's total gradient norm
        self.scaler: LossScaler | None = None  # fp16's loss scaling
        self._clipping: asyncio.Future | None = None

    async def run(self, step: int, batch: Batch, loss: shard_pb2.LossSpec, microbatches: int,
                  schedule: str, after_optimizer_step: int, optimizer_step: int,
                  eval_mode: bool = False, hyperparameters: str = "",
                  clip: tuple[float, float] | None = None) -> tuple[float, asyncio.Future]:
        """One training step on `batch` (on the layers' eval-mode graphs with `eval_mode`) as optimizer step
        `optimizer_step`.
        Returns the batch's loss (the mean loss for averaging losses) as soon as every replica's last stage sent
        it, and a future that ends once every stage of every replica settled the step (then `stats` holds its
        figures), or fails with the step's failure. With `clip` (max_norm, norm_type), the gradients are clipped
        by their global norm before the optimizer step, as torch.nn.utils.clip_grad_norm_ does."""
        if schedule not in schedules.SCHEDULES:
            raise InvalidArgument(f"unknown schedule {schedule!r}; choose one of {schedules.SCHEDULES}")
        plan = shard_pb2.StepPlan(microbatches=microbatches, schedule=schedule)
        shares = [[batch.piece(part) for part in share]
                  for share in split_batch(batch.tensors(), len(self.replicas), microbatches)]
        scale, loss_scale = None, self.scaler.scale if self.scaler is not None and not eval_mode else 0.0
        if clip is not None or loss_scale:
            scale = asyncio.get_running_loop().create_future()
            self._clipping = asyncio.ensure_future(self._clip(scale, step, optimizer_step, *(clip or (None, 2.0))))
        results = await _all_or_nothing([
            clients.planned_step(step, share, batch.rows, loss, plan, after_optimizer_step, optimizer_step, eval_mode,
                                 hyperparameters, scale, loss_scale)
            for clients, share in zip(self.replicas, shares)])
        return sum(value for value, _ in results), asyncio.ensure_future(self._settled([o for _, o in results]))

    async def _clip(self, scale: asyncio.Future, step: int, optimizer_step: int, max_norm: float | None,
                    norm_type: float) -> None:
        """(the gradient scale of global norm clipping and loss scaling, whether to skip the step), from every
        stage's norm once the step's backwards are over (replicas hold the same gradients then: replica 0's stages
        answer). If they cannot answer, the step failed somewhere: it goes unscaled, and every stage refuses it."""
        skip = False
        try:
            norms = await self.replicas[0].gradient_norms([step], norm_type, optimizer_step)
            if self.scaler is not None:
                coefficient, skip, self.grad_norm = self.scaler.verdict(norms, norm_type, max_norm)
            else:
                self.grad_norm, coefficient = clip_coefficient(norms, max_norm, norm_type, error_if_nonfinite=False)
        except Exception:  # noqa: BLE001 - the step's own failure reaches the caller through its verdict
            coefficient = 0.0
        if not scale.done():
            scale.set_result((coefficient, skip))

    async def _settled(self, outcomes: list[asyncio.Future]) -> None:
        per_replica = await _all_or_nothing(outcomes)
        self.stats = [_stats_dict(stats) for per_stage in per_replica for stats in per_stage]
        self.timeline = Timeline.from_stats([stats for per_stage in per_replica for stats in per_stage])


async def _all_or_nothing(calls: list) -> list:
    """Every call's result; on the first failure the others are cancelled and that failure is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
        if failed is not None:
            raise failed.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            let_go(task)  # only the first failure is raised


def _stats_dict(stats: shard_pb2.StageStats) -> dict:
    return {"stage": stats.stage, "replica": stats.replica, "forward_s": stats.forward_seconds,
            "backward_s": stats.backward_seconds, "allreduce_wait_s": stats.allreduce_wait_seconds,
            "optimizer_s": stats.optimizer_seconds, "step_s": stats.step_seconds,
            "busy_fraction": (stats.forward_seconds + stats.backward_seconds) / stats.step_seconds
            if stats.step_seconds else 0.0,
            "peak_activation_bytes": stats.peak_activation_bytes, "peak_in_flight": stats.peak_in_flight,
            "allreduce_backend": stats.allreduce_backend}
