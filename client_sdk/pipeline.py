"""model.train_step: a batch split over replicas and micro-batches, run as one planned step on each replica's Links."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from client_sdk.batch import Batch, split_batch
from client_sdk.inflight import let_go
from client_sdk.loss_scaling import LossScaler
from client_sdk.optimizer import clip_coefficient
from client_sdk.transport import StageClients
from client_sdk.timeline import Timeline
from shardtrain import schedule as schedules
from shardtrain.errors import InvalidArgument
from shardtrain.v1 import shard_pb2


class PipelineTrainer:
    """Runs planned steps over every replica's stages; keeps the last step's figures."""

    def __init__(self, replicas: Sequence[StageClients]):
        self.replicas = list(replicas)
        self.stats: list[dict] = []
        self.timeline = Timeline(())
        self.grad_norm: torch.Tensor | None = None  # the last clipped step's total gradient norm
        self.scaler: LossScaler | None = None  # fp16's loss scaling
        self._clipping: asyncio.Future | None = None

    async def flush(self) -> None:
        """Waits, up to the deadline, until every replica's stages confirmed the optimizer steps sent so far:
        DeadlineExceeded naming a stage that does not answer, where an unbounded wait would hang on it."""
        outcomes = await asyncio.gather(*(clients.flush() for clients in self.replicas), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

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
