"""Tensor <-> header + data chunks: the only code that touches tensor bytes."""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Iterable, Iterator

import torch

from shardtrain.errors import DataLoss, InvalidArgument
from shardtrain.v1 import tensor_pb2

# 1 MiB chunks: a loopback sweep of 64 MiB fp32 transfers (bench/wire_chunks.py) gave 0.37 GB/s at
# 64 KiB, 0.62 GB/s at 256 KiB, 0.71 GB/s at 1 MiB and 0.70 GB/s at 3 MiB; per-message overhead
# dominates below 256 KiB, and larger chunks only raise peak memory.
DEFAULT_CHUNK_BYTES = 1 << 20
# Hard cap on one received tensor, checked against the header before anything is allocated.
MAX_TENSOR_BYTES = 1 << 40

_DTYPES: dict[torch.dtype, int] = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.float64: tensor_pb2.DTYPE_FLOAT64,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.int16: tensor_pb2.DTYPE_INT16,
    torch.int8: tensor_pb2.DTYPE_INT8,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
    torch.bool: tensor_pb2.DTYPE_BOOL,
}
_TORCH_DTYPES = {code: dtype for dtype, code in _DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of a torch dtype; InvalidArgument for dtypes the wire does not carry."""
    if dtype not in _DTYPES:
        raise InvalidArgument(f"dtype {dtype} cannot be sent; supported: {sorted(map(str, _DTYPES))}")
    return _DTYPES[dtype]


def torch_dtype(code: int) -> torch.dtype:
    """The torch dtype of a wire code; InvalidArgument for unknown codes."""
    if code not in _TORCH_DTYPES:
        raise InvalidArgument(f"unknown dtype code {code}; expected one of {sorted(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[code]


def _byte_view(flat: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU uint8 tensor's bytes; the caller keeps `flat` alive."""
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_uint8 * flat.numel()).from_address(flat.data_ptr())).cast("B")


def tensor_chunks(tensor: torch.Tensor, name: str = "",
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tensor_pb2.TensorChunk]:
    """Yields the tensor's bytes in chunks, the first carrying the header; device and layout are normalised first."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    header = tensor_pb2.TensorHeader(name=name, dtype=dtype_code(tensor.dtype),
                                     shape=list(tensor.shape), nbytes=flat.numel())
    view = _byte_view(flat)
    # bytes() is the one copy per chunk that a protobuf bytes field demands.
    yield tensor_pb2.TensorChunk(header=header, data=bytes(view[:chunk_bytes]))
    for offset in range(chunk_bytes, len(view), chunk_bytes):
        yield tensor_pb2.TensorChunk(data=bytes(view[offset:offset + chunk_bytes]))


class TensorAssembler:
    """Builds one tensor from a header and data chunks, written straight into one preallocated buffer."""

    def __init__(self, header: tensor_pb2.TensorHeader, max_bytes: int = MAX_TENSOR_BYTES):
        self.name = header.name
        self.dtype = torch_dtype(header.dtype)
        self.shape = tuple(header.shape)
        if any(dim < 0 for dim in self.shape):
            raise InvalidArgument(f"tensor {self.name!r}: negative dimension in shape {list(self.shape)}")
        expected = _numel(self.shape) * self.dtype.itemsize
        if header.nbytes != expected:
            raise InvalidArgument(f"tensor {self.name!r}: header says {header.nbytes} bytes but shape "
                                  f"{list(self.shape)} of {self.dtype} needs {expected}")
        if expected > max_bytes:
            raise InvalidArgument(f"tensor {self.name!r}: {expected} bytes exceeds the limit of {max_bytes}")
        self._buffer = torch.empty(expected, dtype=torch.uint8)
        self._filled = 0

    @property
    def complete(self) -> bool:
        """True once every byte the header announced has arrived."""
        return self._filled == self._buffer.numel()

    def add(self, data: bytes) -> None:
        """Copies one chunk into place; DataLoss if it overruns the announced size."""
        end = self._filled + len(data)
        if end > self._buffer.numel():
            raise DataLoss(f"tensor {self.name!r}: received {end} bytes, header announced {self._buffer.numel()}")
        ctypes.memmove(self._buffer.data_ptr() + self._filled, data, len(data))
        self._filled = end

    def tensor(self) -> torch.Tensor:
        """The finished tensor; DataLoss if the stream ended early."""
        if not self.complete:
            raise DataLoss(f"tensor {self.name!r}: stream ended after {self._filled} of "
                           f"{self._buffer.numel()} bytes")
        return self._buffer.view(self.dtype).reshape(self.shape)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


class TensorStreamReader:
    """Turns a sequence of TensorChunk messages into (name, tensor) pairs, one tensor at a time."""

    def __init__(self, max_bytes: int = MAX_TENSOR_BYTES):
        self._max_bytes = max_bytes
        self._assembler: TensorAssembler | None = None

    def feed(self, chunk: tensor_pb2.TensorChunk) -> tuple[str, torch.Tensor] | None:
        """Takes one message; returns a tensor as soon as its last byte has arrived."""
        if chunk.HasField("header"):
            if self._assembler is not None:
                raise DataLoss(f"tensor {self._assembler.name!r}: a new header arrived before its data was complete")
            self._assembler = TensorAssembler(chunk.header, self._max_bytes)
        elif self._assembler is None:
            raise InvalidArgument("tensor stream: data chunk before any header")
        self._assembler.add(chunk.data)
        return self._take_if_complete()

    def finish(self) -> None:
        """Checks that the stream did not stop in the middle of a tensor."""
        if self._assembler is not None:
            self._assembler.tensor()

    def _take_if_complete(self) -> tuple[str, torch.Tensor] | None:
        if not self._assembler.complete:
            return None
        done, self._assembler = self._assembler, None
        return done.name, done.tensor()


def read_tensors(chunks: Iterable[tensor_pb2.TensorChunk]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for each header-and-data run in a chunk sequence."""
    reader = TensorStreamReader()
    for chunk in chunks:
        done = reader.feed(chunk)
        if done is not None:
            yield done
    reader.finish()


def framed(message_type, header, tensors: dict[str, torch.Tensor],
           chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator:
    """A request stream of `message_type(header=..., tensor=...)`: the header rides on the first message."""
    first = True
    for name, tensor in tensors.items():
        for chunk in tensor_chunks(tensor, name, chunk_bytes):
            yield message_type(header=header, tensor=chunk) if first else message_type(tensor=chunk)
            first = False
    if first:
        yield message_type(header=header)


async def framed_later(message_type, header, tensors: "asyncio.Future[dict[str, torch.Tensor]]",
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """Like framed(), but the header goes at once and the tensors when the future resolves."""
    yield message_type(header=header)
    for name, tensor in (await tensors).items():
        for chunk in tensor_chunks(tensor, name, chunk_bytes):
            yield message_type(tensor=chunk)


async def collect(chunks) -> dict[str, torch.Tensor]:
    """Every tensor of an async stream of TensorChunk messages, by name."""
    reader, tensors = TensorStreamReader(), {}
    async for chunk in chunks:
        done = reader.feed(chunk)
        if done is not None:
            tensors[done[0]] = done[1]
    reader.finish()
    return tensors
