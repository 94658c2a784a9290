"""What a shard says about itself (model.describe()), as plain data a person can print or compare."""

from __future__ import annotations

from dataclasses import dataclass

from shardtrain import wire
from shardtrain.v1 import coordinator_pb2, shard_pb2


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
