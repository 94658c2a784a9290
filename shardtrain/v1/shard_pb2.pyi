from shardtrain.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORK_KIND_UNSPECIFIED: _ClassVar[WorkKind]
    WORK_KIND_FORWARD: _ClassVar[WorkKind]
    WORK_KIND_BACKWARD: _ClassVar[WorkKind]
    WORK_KIND_ALLREDUCE: _ClassVar[WorkKind]
    WORK_KIND_OPTIMIZER: _ClassVar[WorkKind]
    WORK_KIND_WEIGHT: _ClassVar[WorkKind]

class LinkRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LINK_ROLE_UNSPECIFIED: _ClassVar[LinkRole]
    LINK_ROLE_INPUT: _ClassVar[LinkRole]
    LINK_ROLE_OUTPUT: _ClassVar[LinkRole]
    LINK_ROLE_NEXT: _ClassVar[LinkRole]
    LINK_ROLE_RESIDUAL: _ClassVar[LinkRole]
    LINK_ROLE_TIED: _ClassVar[LinkRole]
WORK_KIND_UNSPECIFIED: WorkKind
WORK_KIND_FORWARD: WorkKind
WORK_KIND_BACKWARD: WorkKind
WORK_KIND_ALLREDUCE: WorkKind
WORK_KIND_OPTIMIZER: WorkKind
WORK_KIND_WEIGHT: WorkKind
LINK_ROLE_UNSPECIFIED: LinkRole
LINK_ROLE_INPUT: LinkRole
LINK_ROLE_OUTPUT: LinkRole
LINK_ROLE_NEXT: LinkRole
LINK_ROLE_RESIDUAL: LinkRole
LINK_ROLE_TIED: LinkRole

class ProbeSharedMemoryRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ProbeSharedMemoryResponse(_message.Message):
    __slots__ = ("token", "uid")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    uid: int
    def __init__(self, token: _Optional[bytes] = ..., uid: _Optional[int] = ...) -> None: ...

class CapturedLayer(_message.Message):
    __slots__ = ("index", "description", "program", "dependencies", "out_variables", "state", "cost", "eval_program", "memory_bytes", "example_inputs", "recompute")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    DEPENDENCIES_FIELD_NUMBER: _ClassVar[int]
    OUT_VARIABLES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    EVAL_PROGRAM_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_INPUTS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    index: int
    description: str
    program: bytes
    dependencies: _containers.RepeatedScalarFieldContainer[str]
    out_variables: _containers.RepeatedScalarFieldContainer[str]
    state: _containers.RepeatedCompositeFieldContainer[StateEntry]
    cost: int
    eval_program: bytes
    memory_bytes: int
    example_inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    recompute: bool
    def __init__(self, index: _Optional[int] = ..., description: _Optional[str] = ..., program: _Optional[bytes] = ..., dependencies: _Optional[_Iterable[str]] = ..., out_variables: _Optional[_Iterable[str]] = ..., state: _Optional[_Iterable[_Union[StateEntry, _Mapping]]] = ..., cost: _Optional[int] = ..., eval_program: _Optional[bytes] = ..., memory_bytes: _Optional[int] = ..., example_inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., recompute: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: _tensor_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ProfileLayersRequest(_message.Message):
    __slots__ = ("layers", "repeats")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[CapturedLayer]
    repeats: int
    def __init__(self, layers: _Optional[_Iterable[_Union[CapturedLayer, _Mapping]]] = ..., repeats: _Optional[int] = ...) -> None: ...

class LayerProfile(_message.Message):
    __slots__ = ("microseconds", "activation_bytes")
    MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    microseconds: int
    activation_bytes: int
    def __init__(self, microseconds: _Optional[int] = ..., activation_bytes: _Optional[int] = ...) -> None: ...

class ProfileLayersResponse(_message.Message):
    __slots__ = ("layers", "device")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerProfile]
    device: str
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerProfile, _Mapping]]] = ..., device: _Optional[str] = ...) -> None: ...

class StateEntry(_message.Message):
    __slots__ = ("graph_key", "model_key", "tied_to", "frozen")
    GRAPH_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_KEY_FIELD_NUMBER: _ClassVar[int]
    TIED_TO_FIELD_NUMBER: _ClassVar[int]
    FROZEN_FIELD_NUMBER: _ClassVar[int]
    graph_key: str
    model_key: str
    tied_to: str
    frozen: bool
    def __init__(self, graph_key: _Optional[str] = ..., model_key: _Optional[str] = ..., tied_to: _Optional[str] = ..., frozen: _Optional[bool] = ...) -> None: ...

class TiedWeight(_message.Message):
    __slots__ = ("key", "stages", "addresses")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    key: str
    stages: _containers.RepeatedScalarFieldContainer[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[str] = ..., stages: _Optional[_Iterable[int]] = ..., addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class ResidualSource(_message.Message):
    __slots__ = ("name", "producer_stage", "producer_address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_STAGE_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    producer_stage: int
    producer_address: str
    def __init__(self, name: _Optional[str] = ..., producer_stage: _Optional[int] = ..., producer_address: _Optional[str] = ...) -> None: ...

class ResidualSink(_message.Message):
    __slots__ = ("name", "consumer_stages", "consumer_addresses")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_STAGES_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    name: str
    consumer_stages: _containers.RepeatedScalarFieldContainer[int]
    consumer_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., consumer_stages: _Optional[_Iterable[int]] = ..., consumer_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class StagePlan(_message.Message):
    __slots__ = ("stage", "num_stages", "previous_address", "next_address", "incoming_residuals", "outgoing_residuals", "replica", "num_replicas", "rendezvous", "tied", "virtual_stages", "shard_addresses")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCOMING_RESIDUALS_FIELD_NUMBER: _ClassVar[int]
    OUTGOING_RESIDUALS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    TIED_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_STAGES_FIELD_NUMBER: _ClassVar[int]
    SHARD_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    stage: int
    num_stages: int
    previous_address: str
    next_address: str
    incoming_residuals: _containers.RepeatedCompositeFieldContainer[ResidualSource]
    outgoing_residuals: _containers.RepeatedCompositeFieldContainer[ResidualSink]
    replica: int
    num_replicas: int
    rendezvous: str
    tied: _containers.RepeatedCompositeFieldContainer[TiedWeight]
    virtual_stages: int
    shard_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stage: _Optional[int] = ..., num_stages: _Optional[int] = ..., previous_address: _Optional[str] = ..., next_address: _Optional[str] = ..., incoming_residuals: _Optional[_Iterable[_Union[ResidualSource, _Mapping]]] = ..., outgoing_residuals: _Optional[_Iterable[_Union[ResidualSink, _Mapping]]] = ..., replica: _Optional[int] = ..., num_replicas: _Optional[int] = ..., rendezvous: _Optional[str] = ..., tied: _Optional[_Iterable[_Union[TiedWeight, _Mapping]]] = ..., virtual_stages: _Optional[int] = ..., shard_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "kwargs_json", "groups")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kwargs_json: str
    groups: _containers.RepeatedCompositeFieldContainer[ParameterGroup]
    def __init__(self, name: _Optional[str] = ..., kwargs_json: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[ParameterGroup, _Mapping]]] = ...) -> None: ...

class ParameterGroup(_message.Message):
    __slots__ = ("parameters", "options_json")
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    parameters: _containers.RepeatedScalarFieldContainer[str]
    options_json: str
    def __init__(self, parameters: _Optional[_Iterable[str]] = ..., options_json: _Optional[str] = ...) -> None: ...

class LoadStageRequest(_message.Message):
    __slots__ = ("deployment_id", "plan", "layers", "optimizer", "encodings", "deployment_secret", "recompute", "precision")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ENCODINGS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    plan: StagePlan
    layers: _containers.RepeatedCompositeFieldContainer[CapturedLayer]
    optimizer: OptimizerSpec
    encodings: _tensor_pb2.WireEncodings
    deployment_secret: str
    recompute: str
    precision: str
    def __init__(self, deployment_id: _Optional[str] = ..., plan: _Optional[_Union[StagePlan, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[CapturedLayer, _Mapping]]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., encodings: _Optional[_Union[_tensor_pb2.WireEncodings, _Mapping]] = ..., deployment_secret: _Optional[str] = ..., recompute: _Optional[str] = ..., precision: _Optional[str] = ...) -> None: ...

class LoadStageResponse(_message.Message):
    __slots__ = ("parameter_count", "rendezvous")
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    parameter_count: int
    rendezvous: str
    def __init__(self, parameter_count: _Optional[int] = ..., rendezvous: _Optional[str] = ...) -> None: ...

class LoadStateHeader(_message.Message):
    __slots__ = ("deployment_id",)
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    def __init__(self, deployment_id: _Optional[str] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("header", "tensor")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    header: LoadStateHeader
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[LoadStateHeader, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class LoadStateResponse(_message.Message):
    __slots__ = ("loaded",)
    LOADED_FIELD_NUMBER: _ClassVar[int]
    loaded: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, loaded: _Optional[_Iterable[str]] = ...) -> None: ...

class ReadStateRequest(_message.Message):
    __slots__ = ("deployment_id", "snapshot")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    snapshot: str
    def __init__(self, deployment_id: _Optional[str] = ..., snapshot: _Optional[str] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("deployment_id", "name", "copy")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    name: str
    copy: bool
    def __init__(self, deployment_id: _Optional[str] = ..., name: _Optional[str] = ..., copy: _Optional[bool] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("optimizer_step", "bytes", "stage", "layer_indexes")
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_INDEXES_FIELD_NUMBER: _ClassVar[int]
    optimizer_step: int
    bytes: int
    stage: int
    layer_indexes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, optimizer_step: _Optional[int] = ..., bytes: _Optional[int] = ..., stage: _Optional[int] = ..., layer_indexes: _Optional[_Iterable[int]] = ...) -> None: ...

class RestoreStageRequest(_message.Message):
    __slots__ = ("deployment_id", "source_address", "snapshot", "source_deployment_secret")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DEPLOYMENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    source_address: str
    snapshot: str
    source_deployment_secret: str
    def __init__(self, deployment_id: _Optional[str] = ..., source_address: _Optional[str] = ..., snapshot: _Optional[str] = ..., source_deployment_secret: _Optional[str] = ...) -> None: ...

class RestoreStageResponse(_message.Message):
    __slots__ = ("optimizer_step", "bytes")
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    optimizer_step: int
    bytes: int
    def __init__(self, optimizer_step: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class CopySnapshotRequest(_message.Message):
    __slots__ = ("name", "source_address", "snapshot", "source_deployment_secret")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DEPLOYMENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    name: str
    source_address: str
    snapshot: str
    source_deployment_secret: str
    def __init__(self, name: _Optional[str] = ..., source_address: _Optional[str] = ..., snapshot: _Optional[str] = ..., source_deployment_secret: _Optional[str] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("deployment_id", "directory", "part", "parts", "description", "generation", "discard")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    directory: str
    part: int
    parts: int
    description: str
    generation: str
    discard: bool
    def __init__(self, deployment_id: _Optional[str] = ..., directory: _Optional[str] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ..., description: _Optional[str] = ..., generation: _Optional[str] = ..., discard: _Optional[bool] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("bytes", "files", "optimizer_step")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    files: _containers.RepeatedScalarFieldContainer[str]
    optimizer_step: int
    def __init__(self, bytes: _Optional[int] = ..., files: _Optional[_Iterable[str]] = ..., optimizer_step: _Optional[int] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("deployment_id", "directory", "optimizer", "check_only")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    directory: str
    optimizer: bool
    check_only: bool
    def __init__(self, deployment_id: _Optional[str] = ..., directory: _Optional[str] = ..., optimizer: _Optional[bool] = ..., check_only: _Optional[bool] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("bytes", "layout")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    layout: str
    def __init__(self, bytes: _Optional[int] = ..., layout: _Optional[str] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("deployment_id", "source", "provided", "check_only")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROVIDED_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    source: str
    provided: _containers.RepeatedScalarFieldContainer[str]
    check_only: bool
    def __init__(self, deployment_id: _Optional[str] = ..., source: _Optional[str] = ..., provided: _Optional[_Iterable[str]] = ..., check_only: _Optional[bool] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("bytes", "loaded", "files")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    loaded: _containers.RepeatedScalarFieldContainer[str]
    files: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, bytes: _Optional[int] = ..., loaded: _Optional[_Iterable[str]] = ..., files: _Optional[_Iterable[str]] = ...) -> None: ...

class DropSnapshotRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DropSnapshotResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: _Optional[bool] = ...) -> None: ...

class OptimizerStateHeader(_message.Message):
    __slots__ = ("deployment_id", "layout", "check_only", "snapshot_optimizer_step", "snapshot_layer_indexes", "snapshot_stage")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_LAYER_INDEXES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_STAGE_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    layout: str
    check_only: bool
    snapshot_optimizer_step: int
    snapshot_layer_indexes: _containers.RepeatedScalarFieldContainer[int]
    snapshot_stage: int
    def __init__(self, deployment_id: _Optional[str] = ..., layout: _Optional[str] = ..., check_only: _Optional[bool] = ..., snapshot_optimizer_step: _Optional[int] = ..., snapshot_layer_indexes: _Optional[_Iterable[int]] = ..., snapshot_stage: _Optional[int] = ...) -> None: ...

class OptimizerStateMessage(_message.Message):
    __slots__ = ("header", "tensor")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    header: OptimizerStateHeader
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[OptimizerStateHeader, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class LoadOptimizerStateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepKey(_message.Message):
    __slots__ = ("deployment_id", "step", "microbatch")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    step: int
    microbatch: int
    def __init__(self, deployment_id: _Optional[str] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ...) -> None: ...

class ForwardHeader(_message.Message):
    __slots__ = ("key", "requires_grad", "zero_grad", "after_optimizer_step", "step_first", "input_requires_grad", "eval_mode", "plan", "keep_output", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    ZERO_GRAD_FIELD_NUMBER: _ClassVar[int]
    AFTER_OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIRST_FIELD_NUMBER: _ClassVar[int]
    INPUT_REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    EVAL_MODE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    KEEP_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: StepKey
    requires_grad: bool
    zero_grad: bool
    after_optimizer_step: int
    step_first: StepRequest
    input_requires_grad: bool
    eval_mode: bool
    plan: StepPlan
    keep_output: bool
    data: DataRows
    def __init__(self, key: _Optional[_Union[StepKey, _Mapping]] = ..., requires_grad: _Optional[bool] = ..., zero_grad: _Optional[bool] = ..., after_optimizer_step: _Optional[int] = ..., step_first: _Optional[_Union[StepRequest, _Mapping]] = ..., input_requires_grad: _Optional[bool] = ..., eval_mode: _Optional[bool] = ..., plan: _Optional[_Union[StepPlan, _Mapping]] = ..., keep_output: _Optional[bool] = ..., data: _Optional[_Union[DataRows, _Mapping]] = ...) -> None: ...

class DataRows(_message.Message):
    __slots__ = ("format", "field", "spans")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    format: str
    field: str
    spans: _containers.RepeatedCompositeFieldContainer[DataSpan]
    def __init__(self, format: _Optional[str] = ..., field: _Optional[str] = ..., spans: _Optional[_Iterable[_Union[DataSpan, _Mapping]]] = ...) -> None: ...

class DataSpan(_message.Message):
    __slots__ = ("url", "rows")
    URL_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    url: str
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, url: _Optional[str] = ..., rows: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("microbatches", "schedule")
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    microbatches: int
    schedule: str
    def __init__(self, microbatches: _Optional[int] = ..., schedule: _Optional[str] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("header", "tensor")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    header: ForwardHeader
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[ForwardHeader, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackwardHeader(_message.Message):
    __slots__ = ("key", "zero_grad")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ZERO_GRAD_FIELD_NUMBER: _ClassVar[int]
    key: StepKey
    zero_grad: bool
    def __init__(self, key: _Optional[_Union[StepKey, _Mapping]] = ..., zero_grad: _Optional[bool] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("header", "tensor")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    header: BackwardHeader
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[BackwardHeader, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class BackwardResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AccumulateGradientHeader(_message.Message):
    __slots__ = ("key", "name", "consumer_stage", "has_gradient")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_STAGE_FIELD_NUMBER: _ClassVar[int]
    HAS_GRADIENT_FIELD_NUMBER: _ClassVar[int]
    key: StepKey
    name: str
    consumer_stage: int
    has_gradient: bool
    def __init__(self, key: _Optional[_Union[StepKey, _Mapping]] = ..., name: _Optional[str] = ..., consumer_stage: _Optional[int] = ..., has_gradient: _Optional[bool] = ...) -> None: ...

class AccumulateGradientRequest(_message.Message):
    __slots__ = ("header", "tensor")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    header: AccumulateGradientHeader
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[AccumulateGradientHeader, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class AccumulateGradientResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FetchTensorRequest(_message.Message):
    __slots__ = ("key", "name", "offset", "shared_memory")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    key: StepKey
    name: str
    offset: int
    shared_memory: bool
    def __init__(self, key: _Optional[_Union[StepKey, _Mapping]] = ..., name: _Optional[str] = ..., offset: _Optional[int] = ..., shared_memory: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("deployment_id", "step", "zero_grad", "optimizer_step", "backward_steps", "backwards_end_with_step", "hyperparameters_json", "gradient_scale", "skip", "gradient_edits")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ZERO_GRAD_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_STEPS_FIELD_NUMBER: _ClassVar[int]
    BACKWARDS_END_WITH_STEP_FIELD_NUMBER: _ClassVar[int]
    HYPERPARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_EDITS_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    step: int
    zero_grad: bool
    optimizer_step: int
    backward_steps: _containers.RepeatedScalarFieldContainer[int]
    backwards_end_with_step: bool
    hyperparameters_json: str
    gradient_scale: float
    skip: bool
    gradient_edits: _containers.RepeatedCompositeFieldContainer[GradientEdit]
    def __init__(self, deployment_id: _Optional[str] = ..., step: _Optional[int] = ..., zero_grad: _Optional[bool] = ..., optimizer_step: _Optional[int] = ..., backward_steps: _Optional[_Iterable[int]] = ..., backwards_end_with_step: _Optional[bool] = ..., hyperparameters_json: _Optional[str] = ..., gradient_scale: _Optional[float] = ..., skip: _Optional[bool] = ..., gradient_edits: _Optional[_Iterable[_Union[GradientEdit, _Mapping]]] = ...) -> None: ...

class GradientEdit(_message.Message):
    __slots__ = ("parameter", "scale", "clamp")
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    CLAMP_FIELD_NUMBER: _ClassVar[int]
    parameter: str
    scale: float
    clamp: Interval
    def __init__(self, parameter: _Optional[str] = ..., scale: _Optional[float] = ..., clamp: _Optional[_Union[Interval, _Mapping]] = ...) -> None: ...

class Interval(_message.Message):
    __slots__ = ("low", "high")
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    low: float
    high: float
    def __init__(self, low: _Optional[float] = ..., high: _Optional[float] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GradientNormRequest(_message.Message):
    __slots__ = ("deployment_id", "optimizer_step", "backward_steps", "norm_type", "edits", "parameters")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_STEPS_FIELD_NUMBER: _ClassVar[int]
    NORM_TYPE_FIELD_NUMBER: _ClassVar[int]
    EDITS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    optimizer_step: int
    backward_steps: _containers.RepeatedScalarFieldContainer[int]
    norm_type: float
    edits: _containers.RepeatedCompositeFieldContainer[GradientEdit]
    parameters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, deployment_id: _Optional[str] = ..., optimizer_step: _Optional[int] = ..., backward_steps: _Optional[_Iterable[int]] = ..., norm_type: _Optional[float] = ..., edits: _Optional[_Iterable[_Union[GradientEdit, _Mapping]]] = ..., parameters: _Optional[_Iterable[str]] = ...) -> None: ...

class GradientNormResponse(_message.Message):
    __slots__ = ("norm", "parameter_norms")
    NORM_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_NORMS_FIELD_NUMBER: _ClassVar[int]
    norm: float
    parameter_norms: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, norm: _Optional[float] = ..., parameter_norms: _Optional[_Iterable[float]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("memory",)
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    memory: bool
    def __init__(self, memory: _Optional[bool] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("address", "device", "deployment_id", "stage", "layer_indexes", "in_flight_steps", "parameter_count", "flush_denormal", "instance", "checkpoint_dir", "client_attached", "memory")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_INDEXES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_STEPS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    FLUSH_DENORMAL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    address: str
    device: str
    deployment_id: str
    stage: int
    layer_indexes: _containers.RepeatedScalarFieldContainer[int]
    in_flight_steps: _containers.RepeatedScalarFieldContainer[int]
    parameter_count: int
    flush_denormal: bool
    instance: str
    checkpoint_dir: str
    client_attached: bool
    memory: StageMemory
    def __init__(self, address: _Optional[str] = ..., device: _Optional[str] = ..., deployment_id: _Optional[str] = ..., stage: _Optional[int] = ..., layer_indexes: _Optional[_Iterable[int]] = ..., in_flight_steps: _Optional[_Iterable[int]] = ..., parameter_count: _Optional[int] = ..., flush_denormal: _Optional[bool] = ..., instance: _Optional[str] = ..., checkpoint_dir: _Optional[str] = ..., client_attached: _Optional[bool] = ..., memory: _Optional[_Union[StageMemory, _Mapping]] = ...) -> None: ...

class StageMemory(_message.Message):
    __slots__ = ("weight_bytes", "gradient_bytes", "optimizer_bytes", "peak_activation_bytes", "peak_process_bytes")
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_PROCESS_BYTES_FIELD_NUMBER: _ClassVar[int]
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    peak_activation_bytes: int
    peak_process_bytes: int
    def __init__(self, weight_bytes: _Optional[int] = ..., gradient_bytes: _Optional[int] = ..., optimizer_bytes: _Optional[int] = ..., peak_activation_bytes: _Optional[int] = ..., peak_process_bytes: _Optional[int] = ...) -> None: ...

class LossSpec(_message.Message):
    __slots__ = ("name", "kwargs_json", "program", "sums", "model_output")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kwargs_json: str
    program: CapturedLayer
    sums: bool
    model_output: str
    def __init__(self, name: _Optional[str] = ..., kwargs_json: _Optional[str] = ..., program: _Optional[_Union[CapturedLayer, _Mapping]] = ..., sums: _Optional[bool] = ..., model_output: _Optional[str] = ...) -> None: ...

class PipelineAction(_message.Message):
    __slots__ = ("backward", "microbatch", "weight")
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    backward: bool
    microbatch: int
    weight: bool
    def __init__(self, backward: _Optional[bool] = ..., microbatch: _Optional[int] = ..., weight: _Optional[bool] = ...) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("stage", "replica", "forward_seconds", "backward_seconds", "allreduce_wait_seconds", "optimizer_seconds", "step_seconds", "peak_activation_bytes", "peak_in_flight", "allreduce_backend", "spans")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEAK_ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    replica: int
    forward_seconds: float
    backward_seconds: float
    allreduce_wait_seconds: float
    optimizer_seconds: float
    step_seconds: float
    peak_activation_bytes: int
    peak_in_flight: int
    allreduce_backend: str
    spans: _containers.RepeatedCompositeFieldContainer[WorkSpan]
    def __init__(self, stage: _Optional[int] = ..., replica: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., backward_seconds: _Optional[float] = ..., allreduce_wait_seconds: _Optional[float] = ..., optimizer_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., peak_activation_bytes: _Optional[int] = ..., peak_in_flight: _Optional[int] = ..., allreduce_backend: _Optional[str] = ..., spans: _Optional[_Iterable[_Union[WorkSpan, _Mapping]]] = ...) -> None: ...

class WorkSpan(_message.Message):
    __slots__ = ("kind", "microbatch", "start", "end")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    kind: WorkKind
    microbatch: int
    start: float
    end: float
    def __init__(self, kind: _Optional[_Union[WorkKind, str]] = ..., microbatch: _Optional[int] = ..., start: _Optional[float] = ..., end: _Optional[float] = ...) -> None: ...

class LinkOpen(_message.Message):
    __slots__ = ("deployment_id", "role", "from_stage", "shared_memory", "local_carrier", "local_address", "local_token", "tcp_carrier")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CARRIER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TCP_CARRIER_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    role: LinkRole
    from_stage: int
    shared_memory: bool
    local_carrier: bool
    local_address: str
    local_token: bytes
    tcp_carrier: bool
    def __init__(self, deployment_id: _Optional[str] = ..., role: _Optional[_Union[LinkRole, str]] = ..., from_stage: _Optional[int] = ..., shared_memory: _Optional[bool] = ..., local_carrier: _Optional[bool] = ..., local_address: _Optional[str] = ..., local_token: _Optional[bytes] = ..., tcp_carrier: _Optional[bool] = ...) -> None: ...

class LinkError(_message.Message):
    __slots__ = ("key", "code", "message", "backward", "optimizer_step", "through_step")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    THROUGH_STEP_FIELD_NUMBER: _ClassVar[int]
    key: StepKey
    code: str
    message: str
    backward: bool
    optimizer_step: int
    through_step: int
    def __init__(self, key: _Optional[_Union[StepKey, _Mapping]] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., backward: _Optional[bool] = ..., optimizer_step: _Optional[int] = ..., through_step: _Optional[int] = ...) -> None: ...

class LinkStep(_message.Message):
    __slots__ = ("request", "failure")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request: StepRequest
    failure: str
    def __init__(self, request: _Optional[_Union[StepRequest, _Mapping]] = ..., failure: _Optional[str] = ...) -> None: ...

class Flush(_message.Message):
    __slots__ = ("optimizer_step", "stats", "stage_stats")
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    STAGE_STATS_FIELD_NUMBER: _ClassVar[int]
    optimizer_step: int
    stats: bool
    stage_stats: _containers.RepeatedCompositeFieldContainer[StageStats]
    def __init__(self, optimizer_step: _Optional[int] = ..., stats: _Optional[bool] = ..., stage_stats: _Optional[_Iterable[_Union[StageStats, _Mapping]]] = ...) -> None: ...

class LossTarget(_message.Message):
    __slots__ = ("key", "loss", "rows", "batch_rows", "data", "loss_scale")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    key: StepKey
    loss: LossSpec
    rows: int
    batch_rows: int
    data: DataRows
    loss_scale: float
    def __init__(self, key: _Optional[_Union[StepKey, _Mapping]] = ..., loss: _Optional[_Union[LossSpec, _Mapping]] = ..., rows: _Optional[int] = ..., batch_rows: _Optional[int] = ..., data: _Optional[_Union[DataRows, _Mapping]] = ..., loss_scale: _Optional[float] = ...) -> None: ...

class StepLoss(_message.Message):
    __slots__ = ("key", "loss")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    key: StepKey
    loss: float
    def __init__(self, key: _Optional[_Union[StepKey, _Mapping]] = ..., loss: _Optional[float] = ...) -> None: ...

class TensorKey(_message.Message):
    __slots__ = ("key", "name", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: StepKey
    name: str
    data: DataRows
    def __init__(self, key: _Optional[_Union[StepKey, _Mapping]] = ..., name: _Optional[str] = ..., data: _Optional[_Union[DataRows, _Mapping]] = ...) -> None: ...

class LinkMessage(_message.Message):
    __slots__ = ("open", "forward", "backward", "step", "flush", "residual", "residual_gradient", "output", "backward_done", "error", "target", "loss", "tied_gradient", "run_done", "tensor")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_GRADIENT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TIED_GRADIENT_FIELD_NUMBER: _ClassVar[int]
    RUN_DONE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    open: LinkOpen
    forward: ForwardHeader
    backward: BackwardHeader
    step: LinkStep
    flush: Flush
    residual: TensorKey
    residual_gradient: TensorKey
    output: TensorKey
    backward_done: TensorKey
    error: LinkError
    target: LossTarget
    loss: StepLoss
    tied_gradient: TiedGradient
    run_done: TensorKey
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, open: _Optional[_Union[LinkOpen, _Mapping]] = ..., forward: _Optional[_Union[ForwardHeader, _Mapping]] = ..., backward: _Optional[_Union[BackwardHeader, _Mapping]] = ..., step: _Optional[_Union[LinkStep, _Mapping]] = ..., flush: _Optional[_Union[Flush, _Mapping]] = ..., residual: _Optional[_Union[TensorKey, _Mapping]] = ..., residual_gradient: _Optional[_Union[TensorKey, _Mapping]] = ..., output: _Optional[_Union[TensorKey, _Mapping]] = ..., backward_done: _Optional[_Union[TensorKey, _Mapping]] = ..., error: _Optional[_Union[LinkError, _Mapping]] = ..., target: _Optional[_Union[LossTarget, _Mapping]] = ..., loss: _Optional[_Union[StepLoss, _Mapping]] = ..., tied_gradient: _Optional[_Union[TiedGradient, _Mapping]] = ..., run_done: _Optional[_Union[TensorKey, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class TiedGradient(_message.Message):
    __slots__ = ("optimizer_step", "key", "from_stage")
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    optimizer_step: int
    key: str
    from_stage: int
    def __init__(self, optimizer_step: _Optional[int] = ..., key: _Optional[str] = ..., from_stage: _Optional[int] = ...) -> None: ...
