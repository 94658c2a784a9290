from shardtrain.v1 import shard_pb2 as _shard_pb2
from shardtrain.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterShardRequest(_message.Message):
    __slots__ = ("address", "device", "memory_bytes", "instance", "device_group", "control_key", "compute")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_GROUP_FIELD_NUMBER: _ClassVar[int]
    CONTROL_KEY_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    address: str
    device: str
    memory_bytes: int
    instance: str
    device_group: str
    control_key: str
    compute: str
    def __init__(self, address: _Optional[str] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., instance: _Optional[str] = ..., device_group: _Optional[str] = ..., control_key: _Optional[str] = ..., compute: _Optional[str] = ...) -> None: ...

class RegisterShardResponse(_message.Message):
    __slots__ = ("shard_id",)
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    def __init__(self, shard_id: _Optional[str] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("shard_id", "address", "device", "memory_bytes", "device_group")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_GROUP_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    address: str
    device: str
    memory_bytes: int
    device_group: str
    def __init__(self, shard_id: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., device_group: _Optional[str] = ...) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListShardsResponse(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...

class PartitionSpec(_message.Message):
    __slots__ = ("num_stages", "split_points", "layers_per_stage", "balance_by_time", "virtual_stages")
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    SPLIT_POINTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_PER_STAGE_FIELD_NUMBER: _ClassVar[int]
    BALANCE_BY_TIME_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_STAGES_FIELD_NUMBER: _ClassVar[int]
    num_stages: int
    split_points: _containers.RepeatedScalarFieldContainer[int]
    layers_per_stage: _containers.RepeatedScalarFieldContainer[int]
    balance_by_time: bool
    virtual_stages: int
    def __init__(self, num_stages: _Optional[int] = ..., split_points: _Optional[_Iterable[int]] = ..., layers_per_stage: _Optional[_Iterable[int]] = ..., balance_by_time: _Optional[bool] = ..., virtual_stages: _Optional[int] = ...) -> None: ...

class DeployRequest(_message.Message):
    __slots__ = ("layers", "optimizer", "partition", "encodings", "replicas", "inputs", "outputs", "prefer_addresses", "take_over", "recompute", "precision")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ENCODINGS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PREFER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    TAKE_OVER_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[_shard_pb2.CapturedLayer]
    optimizer: _shard_pb2.OptimizerSpec
    partition: PartitionSpec
    encodings: _tensor_pb2.WireEncodings
    replicas: int
    inputs: _containers.RepeatedScalarFieldContainer[str]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    prefer_addresses: _containers.RepeatedScalarFieldContainer[str]
    take_over: bool
    recompute: str
    precision: str
    def __init__(self, layers: _Optional[_Iterable[_Union[_shard_pb2.CapturedLayer, _Mapping]]] = ..., optimizer: _Optional[_Union[_shard_pb2.OptimizerSpec, _Mapping]] = ..., partition: _Optional[_Union[PartitionSpec, _Mapping]] = ..., encodings: _Optional[_Union[_tensor_pb2.WireEncodings, _Mapping]] = ..., replicas: _Optional[int] = ..., inputs: _Optional[_Iterable[str]] = ..., outputs: _Optional[_Iterable[str]] = ..., prefer_addresses: _Optional[_Iterable[str]] = ..., take_over: _Optional[bool] = ..., recompute: _Optional[str] = ..., precision: _Optional[str] = ...) -> None: ...

class StageAssignment(_message.Message):
    __slots__ = ("stage", "shard_id", "shard_address", "first_layer", "end_layer", "replica", "cost", "layer_costs")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    LAYER_COSTS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    shard_id: str
    shard_address: str
    first_layer: int
    end_layer: int
    replica: int
    cost: int
    layer_costs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stage: _Optional[int] = ..., shard_id: _Optional[str] = ..., shard_address: _Optional[str] = ..., first_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., replica: _Optional[int] = ..., cost: _Optional[int] = ..., layer_costs: _Optional[_Iterable[int]] = ...) -> None: ...

class DeployResponse(_message.Message):
    __slots__ = ("deployment_id", "stages", "deployment_secret", "cost_unit")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    COST_UNIT_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    stages: _containers.RepeatedCompositeFieldContainer[StageAssignment]
    deployment_secret: str
    cost_unit: str
    def __init__(self, deployment_id: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageAssignment, _Mapping]]] = ..., deployment_secret: _Optional[str] = ..., cost_unit: _Optional[str] = ...) -> None: ...

class PlanScheduleRequest(_message.Message):
    __slots__ = ("num_stages", "microbatches", "schedule", "virtual_stages")
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_STAGES_FIELD_NUMBER: _ClassVar[int]
    num_stages: int
    microbatches: int
    schedule: str
    virtual_stages: int
    def __init__(self, num_stages: _Optional[int] = ..., microbatches: _Optional[int] = ..., schedule: _Optional[str] = ..., virtual_stages: _Optional[int] = ...) -> None: ...

class StageActions(_message.Message):
    __slots__ = ("stage", "actions")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    actions: _containers.RepeatedCompositeFieldContainer[_shard_pb2.PipelineAction]
    def __init__(self, stage: _Optional[int] = ..., actions: _Optional[_Iterable[_Union[_shard_pb2.PipelineAction, _Mapping]]] = ...) -> None: ...

class PlanScheduleResponse(_message.Message):
    __slots__ = ("stages",)
    STAGES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageActions]
    def __init__(self, stages: _Optional[_Iterable[_Union[StageActions, _Mapping]]] = ...) -> None: ...

class DescribeDeploymentRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamedTensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DescribeDeploymentResponse(_message.Message):
    __slots__ = ("deployment_id", "num_stages", "replicas", "stages", "inputs", "outputs")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    num_stages: int
    replicas: int
    stages: _containers.RepeatedCompositeFieldContainer[StageAssignment]
    inputs: _containers.RepeatedCompositeFieldContainer[NamedTensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[NamedTensorSpec]
    def __init__(self, deployment_id: _Optional[str] = ..., num_stages: _Optional[int] = ..., replicas: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageAssignment, _Mapping]]] = ..., inputs: _Optional[_Iterable[_Union[NamedTensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[NamedTensorSpec, _Mapping]]] = ...) -> None: ...
