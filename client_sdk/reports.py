"""What a shard says about itself (model.describe()), as plain data a person can print or compare."""

from __future__ import annotations

from dataclasses import dataclass

from shardtrain.v1 import shard_pb2


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
