"""What a shard says about itself (model.describe()), as plain data a person can print or compare, and the handle's
methods that report on its deployment."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import torch

from client_sdk.event_loop import IoLoop
from client_sdk.loss_scaling import LossScaler
from client_sdk.pipeline import PipelineTrainer
from client_sdk.timeline import Timeline
from client_sdk.transport import StageClients
from shardtrain import wire
from shardtrain.v1 import coordinator_pb2, shard_pb2


class Table(list):
    """A list of reports that prints as a table, one row each (in a notebook too); it is a plain list otherwise."""

    def __str__(self) -> str:
        if not self:
            return "(none)"
        names = [field.name for field in dataclasses.fields(self[0])]
        rows = [names, *([_cell(getattr(row, name)) for name in names] for row in self)]
        widths = [max(len(row[column]) for row in rows) for column in range(len(names))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        return "\n".join([lines[0], "  ".join("-" * width for width in widths), *lines[1:]])

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # IPython and Jupyter show the table
        printer.text(str(self))


def _cell(value) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if len(value) <= 8 else f"{value[0]}..{value[-1]} ({len(value)})"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2**20:
        return f"{value / 2**30:.1f}G" if value >= 2**30 else f"{value / 2**20:.1f}M"
    return str(value)


@dataclass(frozen=True)
class ShardInfo:
    """A shard registered with the coordinator (Cluster.shards()): its id, address, device, the memory it offers
    a stage (bytes) and the group of shards that share its device."""

    shard_id: str
    address: str
    device: str
    memory_bytes: int
    device_group: str

    @classmethod
    def from_message(cls, message: coordinator_pb2.ShardInfo) -> ShardInfo:
        return cls(message.shard_id, message.address, message.device, message.memory_bytes, message.device_group)


@dataclass(frozen=True)
class ShardReport:
    """One stage's shard: where it is, what it computes on, what it holds and what it has in flight."""

    address: str
    device: str
    deployment_id: str
    stage: int
    layer_indexes: tuple[int, ...]   # the model's layers (units) this stage runs
    parameter_count: int
    in_flight_steps: tuple[int, ...]  # steps whose forward ran here and whose backward has not
    flush_denormal: bool              # its CPU arithmetic treats denormal floats as zero
    instance: str                     # the shard's random name, as it registered

    @classmethod
    def from_message(cls, message: shard_pb2.DescribeResponse) -> ShardReport:
        return cls(address=message.address, device=message.device, deployment_id=message.deployment_id,
                   stage=message.stage, layer_indexes=tuple(message.layer_indexes),
                   parameter_count=message.parameter_count, in_flight_steps=tuple(message.in_flight_steps),
                   flush_denormal=message.flush_denormal, instance=message.instance)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor the deployed model takes or returns: its name, dtype and shape (None where the size varies)."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]


@dataclass(frozen=True)
class DeploymentReport:
    """The cluster's current deployment as its coordinator describes it (Cluster.deployment()): where each stage
    of each replica runs, and what the model takes and returns."""

    deployment_id: str
    num_stages: int
    replicas: int
    stages: tuple[tuple[str, ...], ...]  # per replica, each stage's shard address
    inputs: tuple[TensorInfo, ...]       # the main input first
    outputs: tuple[TensorInfo, ...]      # the main output first

    @classmethod
    def from_message(cls, message: coordinator_pb2.DescribeDeploymentResponse) -> DeploymentReport:
        stages = [[""] * message.num_stages for _ in range(message.replicas)]
        for stage in message.stages:
            stages[stage.replica][stage.stage] = stage.shard_address

        def info(spec: coordinator_pb2.NamedTensorSpec) -> TensorInfo:
            dtype = str(wire.torch_dtype(spec.dtype)).removeprefix("torch.")
            return TensorInfo(spec.name, dtype, tuple(None if size < 0 else size for size in spec.shape))
        return cls(message.deployment_id, message.num_stages, message.replicas, tuple(map(tuple, stages)),
                   tuple(map(info, message.inputs)), tuple(map(info, message.outputs)))


class ReportMethods:
    """The handle's report methods (DistributedModel inherits them): its shards described, its replicas, and what
    the last train_step did (gradient norm, stats, timeline), the loss scaling and the memory each stage holds."""

    _io: IoLoop
    _trainer: PipelineTrainer
    _clients: StageClients  # replica 0's
    _check_open: Callable[[], None]  # the handle's: raises once it is closed
    _synchronize: Callable[[], Coroutine[Any, Any, None]]  # the handle's: waits for everything sent so far

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


async def _memory(model: ReportMethods) -> list[dict]:
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
