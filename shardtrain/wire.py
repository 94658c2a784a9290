"""Tensor <-> header + data chunks: the only code that touches tensor bytes.

Copies per chunk, sender: one (the join in codec.Frame serialization; a checksum reads the tensor in
place), then grpc's own. Receiver: grpc's own, then one into the destination tensor, which is
allocated once per tensor; the data arrives as a view of grpc's buffer (codec.Frame), never as a
protobuf field. Same-host peers skip the stream: one copy into a reusable shared segment, which
the receiver maps as the tensor's storage (shm.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy
import torch

from shardtrain import checksums, compression, shm
from shardtrain.codec import Frame
from shardtrain.errors import DataLoss, InvalidArgument, ResourceExhausted
from shardtrain.settings import DEFAULT_CHUNK_BYTES
from shardtrain.v1 import tensor_pb2

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


ENCODINGS: dict[str, int] = {
    "none": tensor_pb2.ENCODING_NONE,
    "fp16": tensor_pb2.ENCODING_FLOAT16,
    "bf16": tensor_pb2.ENCODING_BFLOAT16,
    "int8": tensor_pb2.ENCODING_INT8_BLOCKWISE,
}
_ENCODING_NAMES = {code: name for name, code in ENCODINGS.items()}


def encoding_code(name: str) -> int:
    """The wire code of an encoding name ("none", "fp16", "bf16", "int8"); InvalidArgument otherwise."""
    if name not in ENCODINGS:
        raise InvalidArgument(f"unknown wire encoding {name!r}; expected one of {sorted(ENCODINGS)}")
    return ENCODINGS[name]


def encoding_name(code: int) -> str:
    """The name of an encoding's wire code; InvalidArgument for unknown codes."""
    if code not in _ENCODING_NAMES:
        raise InvalidArgument(f"unknown encoding code {code}; expected one of {sorted(_ENCODING_NAMES)}")
    return _ENCODING_NAMES[code]


TENSOR_KINDS = ("activations", "gradients", "residuals")


def wire_encodings(compression_spec: str | dict[str, str]) -> tensor_pb2.WireEncodings:
    """A deployment's encodings from "none"/"fp16"/"bf16"/"int8" for every kind, or a dict by kind."""
    spec = dict.fromkeys(TENSOR_KINDS, compression_spec) if isinstance(compression_spec, str) else compression_spec
    unknown = sorted(set(spec) - set(TENSOR_KINDS))
    if unknown:
        raise InvalidArgument(f"compression names unknown tensor kinds {unknown}; expected some of {TENSOR_KINDS}")
    return tensor_pb2.WireEncodings(**{kind: encoding_code(name) for kind, name in spec.items()})


@dataclass(frozen=True)
class SendOptions:
    """How tensors go to one peer: chunk size, wire encoding, and segments when the peer shares this host."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    encoding: int = tensor_pb2.ENCODING_NONE
    segments: shm.SegmentPool | None = None
    checksum: str = checksums.DEFAULT  # the kind each chunk carries of its data (checksums.py): one more pass


EXACT = SendOptions()


class _HostBytes:
    """A tensor's bytes as a flat uint8 CPU tensor; from CUDA, copied chunk by chunk into pinned memory
    on a side stream, so the first chunks can be sent while later ones are still being copied."""

    def __init__(self, tensor: torch.Tensor, chunk_bytes: int):
        tensor = tensor.detach()
        self._events: list = []
        self._chunk_bytes = chunk_bytes
        if not tensor.is_cuda:
            self.flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            return
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        self.flat = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.Stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor's producer first
        with torch.cuda.stream(stream):
            for offset in range(0, flat.numel(), chunk_bytes):
                self.flat[offset:offset + chunk_bytes].copy_(flat[offset:offset + chunk_bytes], non_blocking=True)
                self._events.append(torch.cuda.Event())
                self._events[-1].record(stream)
        flat.record_stream(stream)  # the caching allocator must not reuse it before the copies end

    def wait(self, end: int) -> None:
        """Blocks until bytes [0, end) are in host memory (at once on CPU)."""
        if self._events and end > 0:
            self._events[min(end - 1, self.flat.numel() - 1) // self._chunk_bytes].synchronize()


def _payload(tensor: torch.Tensor, options: SendOptions) -> tuple[_HostBytes, int]:
    """(wire bytes, encoding actually used): lossy encodings only change floating-point tensors, and never a
    scalar (a loss), which costs nothing to send exact."""
    name = encoding_name(options.encoding)
    if options.encoding != tensor_pb2.ENCODING_NONE and compression.applies(name, tensor.dtype) and tensor.dim():
        return _HostBytes(compression.encode(tensor.detach(), name), options.chunk_bytes), options.encoding
    return _HostBytes(tensor, options.chunk_bytes), tensor_pb2.ENCODING_NONE


def _same(chunk: tensor_pb2.TensorChunk) -> tensor_pb2.TensorChunk:
    return chunk


def tensor_frames(tensor: torch.Tensor, name: str = "", options: SendOptions = EXACT,
                  wrap: Callable[[tensor_pb2.TensorChunk], object] = _same, start: int = 0) -> Iterator[Frame]:
    """The frames of one tensor, the first carrying its header: data chunks, or one shared segment.

    `wrap` puts each chunk in the stream's message type; `start` resumes from a wire-byte offset.
    """
    payload, encoding = _payload(tensor, options)
    size = payload.flat.numel()
    header = tensor_pb2.TensorHeader(name=name, dtype=dtype_code(tensor.dtype), shape=list(tensor.shape),
                                     nbytes=tensor.numel() * tensor.dtype.itemsize, encoding=encoding,
                                     wire_nbytes=size)
    if start == 0 and options.segments is not None and size >= shm.MIN_BYTES:
        payload.wait(size)
        shared = _share(payload.flat, options.segments)
        if shared is not None:
            yield Frame(wrap(tensor_pb2.TensorChunk(header=header, shared=shared)))
            return
    # A numpy array's buffer keeps `payload.flat` alive for as long as any frame's view of it exists.
    view = memoryview(payload.flat.numpy()) if size else memoryview(b"")
    for offset in range(start, size, options.chunk_bytes) or [start]:
        payload.wait(offset + options.chunk_bytes)
        data = view[offset:offset + options.chunk_bytes]
        chunk = tensor_pb2.TensorChunk(offset=offset)
        checksums.stamp(chunk, data, options.checksum)
        if offset == start:
            chunk.header.CopyFrom(header)
        yield Frame(wrap(chunk), data)


def _share(payload: torch.Tensor, segments: shm.SegmentPool) -> tensor_pb2.SharedSegment | None:
    placed = segments.put(payload)
    if placed is None:
        return None
    path, offset, generation = placed
    return tensor_pb2.SharedSegment(path=path, offset=offset, generation=generation)


def meta(header: tensor_pb2.TensorHeader) -> torch.Tensor:
    """A tensor on the meta device with the header's dtype and shape: what it would be, with no storage."""
    if any(dim < 0 for dim in header.shape) or len(header.shape) > 64:
        raise InvalidArgument(f"tensor {header.name[:80]!r}: shape {list(header.shape)[:64]} is not a shape")
    return torch.empty(tuple(header.shape), dtype=torch_dtype(header.dtype), device="meta")


class TensorAssembler:
    """Builds one tensor from a header and its data: chunks written into one buffer, or a mapped segment."""

    def __init__(self, header: tensor_pb2.TensorHeader, max_bytes: int = MAX_TENSOR_BYTES):
        self.header = header
        self.name = header.name
        self.dtype = torch_dtype(header.dtype)
        self.shape = tuple(header.shape)
        self.encoding = encoding_name(header.encoding)
        if any(dim < 0 for dim in self.shape):
            raise InvalidArgument(f"tensor {self.name!r}: negative dimension in shape {list(self.shape)}")
        numel = _numel(self.shape)
        expected = numel * self.dtype.itemsize
        if header.nbytes != expected:
            raise InvalidArgument(f"tensor {self.name!r}: header says {header.nbytes} bytes but shape "
                                  f"{list(self.shape)} of {self.dtype} needs {expected}")
        if expected > max_bytes:
            raise InvalidArgument(f"tensor {self.name!r}: {expected} bytes exceeds the limit of {max_bytes}")
        self.wire_nbytes = compression.encoded_nbytes(self.encoding, self.dtype, numel)
        if header.wire_nbytes != self.wire_nbytes:
            raise InvalidArgument(f"tensor {self.name!r}: header says {header.wire_nbytes} wire bytes but "
                                  f"{self.encoding} encoding of {list(self.shape)} {self.dtype} needs "
                                  f"{self.wire_nbytes}")
        self._buffer: torch.Tensor | None = None
        self.filled = 0

    @property
    def complete(self) -> bool:
        """True once every wire byte the header announced has arrived."""
        return self.filled == self.wire_nbytes

    def add(self, chunk: tensor_pb2.TensorChunk, data) -> None:
        """Takes one chunk's data, or its shared segment; DataLoss if it is out of place, corrupt or too long."""
        if chunk.HasField("shared"):
            return self._map(chunk.shared)
        if chunk.offset != self.filled:
            raise DataLoss(f"tensor {self.name!r}: chunk at offset {chunk.offset}, expected {self.filled}")
        checksums.verify(chunk, data, self.name)
        end = self.filled + len(data)
        if end > self.wire_nbytes:
            raise DataLoss(f"tensor {self.name!r}: received {end} bytes, header announced {self.wire_nbytes}")
        if len(data):
            destination = self._allocated().numpy()[self.filled:end]
            source = numpy.frombuffer(data, dtype=numpy.uint8)
            if source.ctypes.data != destination.ctypes.data:  # else it was received in place (place())
                destination[:] = source
        self.filled = end

    def place(self, chunk: tensor_pb2.TensorChunk, nbytes: int) -> memoryview | None:
        """Where the next chunk's `nbytes` of data can be received straight into the tensor, or None (a chunk
        out of place or too long, which add() then refuses)."""
        if chunk.HasField("shared") or chunk.offset != self.filled or self.filled + nbytes > self.wire_nbytes:
            return None
        return memoryview(self._allocated().numpy())[self.filled:self.filled + nbytes]

    def _allocated(self) -> torch.Tensor:
        if self._buffer is None:
            try:
                self._buffer = torch.empty(self.wire_nbytes, dtype=torch.uint8)
            except RuntimeError:  # the allocator's "can't allocate memory": a header beyond this host's memory
                raise ResourceExhausted(f"tensor {self.name!r}: no memory for its {self.wire_nbytes} bytes") from None
        return self._buffer

    def _map(self, shared: tensor_pb2.SharedSegment) -> None:
        if self.filled:
            raise DataLoss(f"tensor {self.name!r}: a shared segment arrived after {self.filled} bytes of chunks")
        self._buffer = shm.open_segment(shared.path, shared.offset, shared.generation, self.wire_nbytes)
        self.filled = self.wire_nbytes

    def tensor(self) -> torch.Tensor:
        """The finished tensor; DataLoss if the stream ended early."""
        if not self.complete:
            raise DataLoss(f"tensor {self.name!r}: stream ended after {self.filled} of "
                           f"{self.wire_nbytes} bytes")
        buffer = self._buffer if self._buffer is not None else torch.empty(0, dtype=torch.uint8)
        if self.encoding != "none" and compression.applies(self.encoding, self.dtype):
            return compression.decode(buffer, self.encoding, self.dtype, self.shape)
        return buffer.view(self.dtype).reshape(self.shape)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


class TensorStreamReader:
    """Turns a sequence of Frames into (name, tensor) pairs, one tensor at a time."""

    def __init__(self, max_bytes: int = MAX_TENSOR_BYTES,
                 expect: Callable[[tensor_pb2.TensorHeader], None] | None = None):
        self._max_bytes = max_bytes
        self._expect = expect  # raises for a header the receiver will not take, before anything is stored
        self._assembler: TensorAssembler | None = None

    @property
    def resume_offset(self) -> int:
        """Wire bytes of the unfinished tensor already received: where a resumed stream must start."""
        return self._assembler.filled if self._assembler is not None else 0

    def feed(self, frame: Frame) -> tuple[str, torch.Tensor] | None:
        """Takes one frame; returns a tensor as soon as its last byte has arrived."""
        chunk = frame.chunk
        if chunk is None:
            return None
        if chunk.HasField("header"):
            self._open(chunk)
        elif self._assembler is None:
            raise InvalidArgument("tensor stream: data chunk before any header")
        self._assembler.add(chunk, frame.data)
        return self._take_if_complete()

    def place(self, chunk: tensor_pb2.TensorChunk, nbytes: int) -> memoryview | None:
        """Where a chunk about to be fed can have its `nbytes` of data received, straight into its tensor; None
        where it cannot (feed() then takes the data from a buffer of its own, or says what is wrong)."""
        if chunk.HasField("header"):
            if self._assembler is not None:
                return None  # a resumed stream or an error: feed() tells which
            self._open(chunk)
        return self._assembler.place(chunk, nbytes) if self._assembler is not None else None

    def _open(self, chunk: tensor_pb2.TensorChunk) -> None:
        current = self._assembler
        if current is None:
            if self._expect is not None:
                self._expect(chunk.header)
            self._assembler = TensorAssembler(chunk.header, self._max_bytes)
        elif chunk.header != current.header or chunk.offset != current.filled:
            # The same header again at the offset reached is a resumed stream; anything else is a new tensor.
            raise DataLoss(f"tensor {current.name!r}: a new header arrived before its data was complete")

    def finish(self) -> None:
        """Checks that the stream did not stop in the middle of a tensor."""
        if self._assembler is not None:
            self._assembler.tensor()

    def _take_if_complete(self) -> tuple[str, torch.Tensor] | None:
        if not self._assembler.complete:
            return None
        done, self._assembler = self._assembler, None
        return done.name, done.tensor()


def read_tensors(frames: Iterable[Frame]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for each header-and-data run in a frame sequence."""
    reader = TensorStreamReader()
    for frame in frames:
        done = reader.feed(frame)
        if done is not None:
            yield done
    reader.finish()


def _wrapper(message_type, header) -> Callable:
    """Wraps chunks in `message_type`, the request header riding on the first message only."""
    first = [True]

    def wrap(chunk):
        if first[0]:
            first[0] = False
            return message_type(header=header, tensor=chunk)
        return message_type(tensor=chunk)
    return wrap


def framed(message_type, header, tensors: dict[str, torch.Tensor], options: SendOptions = EXACT) -> Iterator[Frame]:
    """A request stream of `message_type(header=..., tensor=...)` frames: the header rides on the first."""
    wrap = _wrapper(message_type, header)
    for name, tensor in tensors.items():
        yield from tensor_frames(tensor, name, options, wrap)
    if not tensors:
        yield Frame(message_type(header=header))


async def each_tensor(frames, reader: TensorStreamReader | None = None):
    """Yields (name, tensor) of an async stream of Frames as soon as each is complete; `reader` keeps a
    partial tensor (for resuming)."""
    reader = reader or TensorStreamReader()
    async for frame in frames:
        done = reader.feed(frame)
        if done is not None:
            yield done
    reader.finish()


async def collect(frames, reader: TensorStreamReader | None = None, count: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of an async stream of Frames, by name: all of them, or the first `count` as soon as they
    are complete (without waiting for the sender to close its side). `reader` keeps a partial tensor."""
    tensors = {}
    async with contextlib.aclosing(each_tensor(frames, reader)) as stream:
        async for name, tensor in stream:
            tensors[name] = tensor
            if len(tensors) == count:
                break
    return tensors
