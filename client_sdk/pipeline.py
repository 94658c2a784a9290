"""model.train_step: a batch split over replicas and micro-batches, one TrainStep call per shard, all at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import torch

from client_sdk.transport import StageClients
from shardtrain import schedule as schedules
from shardtrain.errors import InvalidArgument
from shardtrain.v1 import shard_pb2

Planner = Callable[[int, int, str], Awaitable[list]]  # (stages, microbatches, schedule) -> actions per stage


def split_batch(x: torch.Tensor, y: torch.Tensor, replicas: int, microbatches: int) -> list[list[tuple]]:
    """Per replica, its micro-batches as (input, target) pairs; the last ones may be a row shorter."""
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
        raise InvalidArgument(f"inputs and targets need the same batch dimension, got {list(x.shape)} and "
                              f"{list(y.shape)}")
    if microbatches < 1:
        raise InvalidArgument(f"microbatches must be at least 1, got {microbatches}")
    if x.shape[0] < replicas * microbatches:
        raise InvalidArgument(f"a batch of {x.shape[0]} rows cannot feed {replicas} replica(s) x {microbatches} "
                              "micro-batches: each needs at least one row")
    return [list(zip(torch.tensor_split(xr, microbatches), torch.tensor_split(yr, microbatches)))
            for xr, yr in zip(torch.tensor_split(x, replicas), torch.tensor_split(y, replicas))]


class PipelineTrainer:
    """Runs TrainSteps over every replica's stages; keeps the coordinator's plans and the last step's figures."""

    def __init__(self, replicas: Sequence[StageClients], planner: Planner):
        self.replicas = list(replicas)
        self._planner = planner
        self._plans: dict[tuple[int, str], list] = {}
        self.stats: list[dict] = []

    async def _plan(self, microbatches: int, schedule: str) -> list:
        if schedule not in schedules.SCHEDULES:
            raise InvalidArgument(f"unknown schedule {schedule!r}; choose one of {schedules.SCHEDULES}")
        key = (microbatches, schedule)
        if key not in self._plans:  # one coordinator round trip per distinct plan, none per micro-batch
            self._plans[key] = await self._planner(len(self.replicas[0].stages), microbatches, schedule)
        return self._plans[key]

    async def run(self, step: int, x: torch.Tensor, y: torch.Tensor, loss: shard_pb2.LossSpec,
                  microbatches: int, schedule: str, eval_mode: bool = False) -> float:
        """One training step (on the layers' eval-mode graphs with `eval_mode`); returns the batch's loss (the
        mean loss for averaging losses)."""
        plan = await self._plan(microbatches, schedule)
        shares = split_batch(x.detach(), y.detach(), len(self.replicas), microbatches)
        calls = [call for clients, share in zip(self.replicas, shares)
                 for call in self._replica_calls(clients, step, share, x.shape[0], plan, loss, eval_mode)]
        responses = await _all_or_nothing(calls)
        self.stats = [_stats_dict(response.stats) for response in responses]
        return sum(response.loss for response in responses)

    def _replica_calls(self, clients: StageClients, step: int, share: list[tuple], batch_size: int,
                       plan: list, loss: shard_pb2.LossSpec, eval_mode: bool) -> list:
        last = len(clients.stages) - 1
        calls = []
        for stage, actions in enumerate(plan):
            header = shard_pb2.TrainStepHeader(key=clients.key(step), microbatch_sizes=[len(mx) for mx, _ in share],
                                               batch_size=batch_size, actions=actions,
                                               loss=loss if stage == last else None, eval_mode=eval_mode)
            tensors = {f"input/{k}": mx for k, (mx, _) in enumerate(share)} if stage == 0 else {}
            tensors.update({f"target/{k}": my for k, (_, my) in enumerate(share)} if stage == last else {})
            calls.append(clients.train_step(stage, header, tensors))
        return calls


async def _all_or_nothing(calls: list) -> list:
    """Every call's result; on the first failure the others are cancelled (their shards stop waiting for
    tensors that will never come and drop the step) and that failure is raised."""
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
