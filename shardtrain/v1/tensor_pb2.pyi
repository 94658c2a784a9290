from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_NONE: _ClassVar[Encoding]
    ENCODING_FLOAT16: _ClassVar[Encoding]
    ENCODING_BFLOAT16: _ClassVar[Encoding]
    ENCODING_INT8_BLOCKWISE: _ClassVar[Encoding]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_INT16: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType
ENCODING_NONE: Encoding
ENCODING_FLOAT16: Encoding
ENCODING_BFLOAT16: Encoding
ENCODING_INT8_BLOCKWISE: Encoding

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "encoding", "wire_nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    WIRE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    encoding: Encoding
    wire_nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., wire_nbytes: _Optional[int] = ...) -> None: ...

class SharedSegment(_message.Message):
    __slots__ = ("path", "offset", "generation")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    generation: int
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("header", "data", "offset", "crc32", "shared", "crc32c")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    data: bytes
    offset: int
    crc32: int
    shared: SharedSegment
    crc32c: int
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., crc32: _Optional[int] = ..., shared: _Optional[_Union[SharedSegment, _Mapping]] = ..., crc32c: _Optional[int] = ...) -> None: ...

class WireEncodings(_message.Message):
    __slots__ = ("activations", "gradients", "residuals")
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    RESIDUALS_FIELD_NUMBER: _ClassVar[int]
    activations: Encoding
    gradients: Encoding
    residuals: Encoding
    def __init__(self, activations: _Optional[_Union[Encoding, str]] = ..., gradients: _Optional[_Union[Encoding, str]] = ..., residuals: _Optional[_Union[Encoding, str]] = ...) -> None: ...
