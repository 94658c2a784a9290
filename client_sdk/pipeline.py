"""model.train_step: a batch split over replicas and micro-batches, run as one planned step on each replica's Links."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from client_sdk.optimizer import clip_coefficient
from client_sdk.transport import StageClients
from shardtrain import schedule as schedules
from shardtrain.errors import InvalidArgument
from shardtrain.v1 import shard_pb2


def split_batch(x: torch.Tensor, y: torch.Tensor, replicas: int, microbatches: int) -> list[list[tuple]]:
    """Per replica, its micro-batches as (input, target) pairs; the last ones may be a row shorter."""
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
        raise InvalidArgument(f"inputs and targets need the same batch dimension, got {list(x.shape)} and "
                              f"{list(y.shape)}")
    if not isinstance(microbatches, int) or not 1 <= microbatches <= schedules.MAX_MICROBATCHES:
        raise InvalidArgument(f"microbatches must be an integer in 1..{schedules.MAX_MICROBATCHES}, "
                              f"got {microbatches!r}")
    if x.shape[0] < replicas * microbatches:
        raise InvalidArgument(f"a batch of {x.shape[0]} rows cannot feed {replicas} replica(s) x {microbatches} "
                              "micro-batches: each needs at least one row")
    return [list(zip(torch.tensor_split(xr, microbatches), torch.tensor_split(yr, microbatches)))
            for xr, yr in zip(torch.tensor_split(x, replicas), torch.tensor_split(y, replicas))]


class PipelineTrainer:
    """Runs planned steps over every replica's stages; keeps the last step's figures."""

    def __init__(self, replicas: Sequence[StageClients]):
        self.replicas = list(replicas)
        self.stats: list[dict] = []
        self.grad_norm: torch.Tensor | None = None  # the last clipped step's total gradient norm
        self._clipping: asyncio.Future | None = None

    async def run(self, step: int, x: torch.Tensor, y: torch.Tensor, loss: shard_pb2.LossSpec, microbatches: int,
                  schedule: str, after_optimizer_step: int, optimizer_step: int,
                  eval_mode: bool = False, hyperparameters: str = "",
                  clip: tuple[float, float] | None = None) -> tuple[float, asyncio.Future]:
        """One training step (on the layers' eval-mode graphs with `eval_mode`) as optimizer step `optimizer_step`.
        Returns the batch's loss (the mean loss for averaging losses) as soon as every replica's last stage sent
        it, and a future that ends once every stage of every replica settled the step (then `stats` holds its
        figures), or fails with the step's failure. With `clip` (max_norm, norm_type), the gradients are clipped
        by their global norm before the optimizer step, as torch.nn.utils.clip_grad_norm_ does."""
        if schedule not in schedules.SCHEDULES:
            raise InvalidArgument(f"unknown schedule {schedule!r}; choose one of {schedules.SCHEDULES}")
        plan = shard_pb2.StepPlan(microbatches=microbatches, schedule=schedule)
        shares = split_batch(x.detach(), y.detach(), len(self.replicas), microbatches)
        scale = None
        if clip is not None:
            scale = asyncio.get_running_loop().create_future()
            self._clipping = asyncio.ensure_future(self._clip(scale, step, optimizer_step, *clip))
        results = await _all_or_nothing([
            clients.planned_step(step, share, x.shape[0], loss, plan, after_optimizer_step, optimizer_step, eval_mode,
                                 hyperparameters, scale)
            for clients, share in zip(self.replicas, shares)])
        return sum(value for value, _ in results), asyncio.ensure_future(self._settled([o for _, o in results]))

    async def _clip(self, scale: asyncio.Future, step: int, optimizer_step: int, max_norm: float,
                    norm_type: float) -> None:
        """The gradient scale of global norm clipping, from every stage's norm once the step's backwards are over
        (replicas hold the same gradients then: replica 0's stages answer). If they cannot answer, the step failed
        somewhere: it goes unscaled, and every stage refuses it."""
        try:
            norms = await self.replicas[0].gradient_norms([step], norm_type, optimizer_step)
            self.grad_norm, coefficient = clip_coefficient(norms, max_norm, norm_type, error_if_nonfinite=False)
        except Exception:  # noqa: BLE001 - the step's own failure reaches the caller through its verdict
            coefficient = 0.0
        if not scale.done():
            scale.set_result(coefficient)

    async def _settled(self, outcomes: list[asyncio.Future]) -> None:
        per_replica = await _all_or_nothing(outcomes)
        self.stats = [_stats_dict(stats) for per_stage in per_replica for stats in per_stage]


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
            task.cancel()


def _stats_dict(stats: shard_pb2.StageStats) -> dict:
    return {"stage": stats.stage, "replica": stats.replica, "forward_s": stats.forward_seconds,
            "backward_s": stats.backward_seconds, "allreduce_wait_s": stats.allreduce_wait_seconds,
            "optimizer_s": stats.optimizer_seconds, "step_s": stats.step_seconds,
            "busy_fraction": (stats.forward_seconds + stats.backward_seconds) / stats.step_seconds
            if stats.step_seconds else 0.0,
            "peak_activation_bytes": stats.peak_activation_bytes, "peak_in_flight": stats.peak_in_flight}
