"""Link items packed in a fixed binary header: the same-host carrier's form of the items every step sends.

Why: each item a step sends costs a shard CPU in proportion to the code and objects it touches (the
protobuf message, the tensor stream's reader and assembler, the path-addressed segment's checks), and a
step makes several such hops on its critical path. Packed, an item is one struct, the residual's name,
and the segment's number or the tensor's bytes (docs/performance.md: "Packed items").

The items packed are forward, backward, output, backward_done, residual and residual_gradient, whose
key names the link's own deployment, with a CPU tensor of at most MAX_DIMS dimensions that goes
exactly (no lossy wire encoding). Anything else travels as a LinkMessage on the same socket.

A packed frame on the carrier (after the frame's length) is PACKED_MARK (4 bytes, where a LinkMessage
frame has its message's length), then, little-endian:
  kind (u8: the LinkMessage field number), flags (u8), dtype (u8: the DType code), ndim (u8),
  name length (u16), microbatch (i32), step (i64), after_optimizer_step (i64), tensor bytes (i64),
  ndim dimensions (i64 each), the name (UTF-8),
  then, with SHARED, the segment: its sender's pid (u32), number (u64) and generation (i64);
  else, with TENSOR, the tensor's bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from shardtrain import compression, shm, wire
from shardtrain.errors import DataLoss, InvalidArgument
from shardtrain.v1 import shard_pb2, tensor_pb2

PACKED_MARK = 0xFFFFFFFF  # never a LinkMessage's length: a frame holds at most carrier.MAX_FRAME_BYTES
MAX_DIMS = 8
TENSOR, SHARED, REQUIRES_GRAD, ZERO_GRAD, INPUT_REQUIRES_GRAD, EVAL_MODE = 1, 2, 4, 8, 16, 32

_FIELDS = shard_pb2.LinkMessage.DESCRIPTOR.fields_by_name
FORWARD, BACKWARD = _FIELDS["forward"].number, _FIELDS["backward"].number
_KEYED = {_FIELDS[name].number: name for name in ("residual", "residual_gradient", "output", "backward_done")}
KINDS = {FORWARD: "forward", BACKWARD: "backward", **_KEYED}
_NUMBERS = {name: number for number, name in KINDS.items()}

_FIXED = "<BBBBHiqqq"
_HEADS = [struct.Struct(_FIXED + "q" * ndim) for ndim in range(MAX_DIMS + 1)]
_BASE = _HEADS[0]
_SEGMENT = struct.Struct("<IQq")
_MARK = struct.Struct("<I").pack(PACKED_MARK)
_NONE = tensor_pb2.ENCODING_NONE


@dataclass(slots=True)
class PackedFrame:
    """A packed item as the carrier cut it: its bytes after PACKED_MARK, a view of what the socket read."""

    body: memoryview


def pack(message: shard_pb2.LinkMessage, tensor: torch.Tensor | None, options: wire.SendOptions,
         deployment_id: str) -> tuple[bytes, object] | None:
    """(the frame's packed head, the tensor's bytes or b"") for a frequent item, or None: it goes as a LinkMessage."""
    kind = message.WhichOneof("item")
    number = _NUMBERS.get(kind)
    if number is None:
        return None
    item = getattr(message, kind)
    flags, after, name = 0, 0, b""
    if number == FORWARD:
        if item.HasField("step_first") or item.HasField("plan"):
            return None
        flags = (REQUIRES_GRAD * item.requires_grad | ZERO_GRAD * item.zero_grad
                 | INPUT_REQUIRES_GRAD * item.input_requires_grad | EVAL_MODE * item.eval_mode)
        after = item.after_optimizer_step
    elif number == BACKWARD:
        flags = ZERO_GRAD * item.zero_grad
    else:
        name = item.name.encode()
    key = item.key
    if key.deployment_id != deployment_id or len(name) > 0xFFFF:
        return None
    if tensor is None:
        return _MARK + _BASE.pack(number, flags, 0, 0, len(name), key.microbatch, key.step, after, 0) + name, b""
    return _pack_tensor(number, flags, name, key, after, tensor, options)


def _pack_tensor(number: int, flags: int, name: bytes, key: shard_pb2.StepKey, after: int, tensor: torch.Tensor,
                 options: wire.SendOptions) -> tuple[bytes, object] | None:
    ndim = tensor.dim()
    if tensor.is_cuda or ndim > MAX_DIMS or (
            options.encoding != _NONE and compression.applies(wire.encoding_name(options.encoding), tensor.dtype)):
        return None  # CUDA's pinned staging and the lossy encodings live in wire.py
    dtype = wire.dtype_code(tensor.dtype)  # InvalidArgument for a dtype the wire does not carry, as unpacked
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    size = flat.numel()
    placed = options.segments.put_numbered(flat) if options.segments is not None and size >= shm.MIN_BYTES else None
    flags |= TENSOR if placed is None else TENSOR | SHARED
    head = _MARK + _HEADS[ndim].pack(number, flags, dtype, ndim, len(name), key.microbatch, key.step, after, size,
                                     *tensor.shape) + name
    if placed is not None:
        return head + _SEGMENT.pack(*placed), b""
    return head, memoryview(flat.numpy()) if size else b""


def unpack(body: memoryview, deployment_id: str) -> tuple[shard_pb2.LinkMessage, torch.Tensor | None]:
    """The item of a packed frame's `body` (after PACKED_MARK), keyed by the link's deployment."""
    if len(body) < _BASE.size:
        raise DataLoss(f"local link: a packed item of {len(body)} bytes is shorter than its {_BASE.size}-byte header")
    number, flags, dtype, ndim, name_size, microbatch, step, after, nbytes = _BASE.unpack_from(body)
    kind = KINDS.get(number)
    if kind is None:
        raise InvalidArgument(f"local link: packed item kind {number} is none of {sorted(KINDS)} ({sorted(_NUMBERS)})")
    if ndim > MAX_DIMS:
        raise InvalidArgument(f"local link: a packed {kind} item's tensor has {ndim} dimensions, at most "
                              f"{MAX_DIMS} allowed")
    position = _HEADS[ndim].size
    end = position + name_size
    if end > len(body):
        raise DataLoss(f"local link: a packed {kind} item of {len(body)} bytes ends inside its header")
    shape = _HEADS[ndim].unpack_from(body)[9:]
    key = shard_pb2.StepKey(deployment_id=deployment_id, step=step, microbatch=microbatch)
    message = _message(number, kind, key, flags, after, body[position:end])
    if not flags & TENSOR:
        if nbytes or len(body) != end:
            raise DataLoss(f"local link: a packed {kind} item without a tensor carries {len(body) - end} bytes")
        return message, None
    return message, _tensor(kind, flags, wire.torch_dtype(dtype), shape, nbytes, body[end:])


def _message(number: int, kind: str, key: shard_pb2.StepKey, flags: int, after: int,
             name: memoryview) -> shard_pb2.LinkMessage:
    if number == FORWARD:
        return shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader(
            key=key, requires_grad=bool(flags & REQUIRES_GRAD), zero_grad=bool(flags & ZERO_GRAD),
            after_optimizer_step=after, input_requires_grad=bool(flags & INPUT_REQUIRES_GRAD),
            eval_mode=bool(flags & EVAL_MODE)))
    if number == BACKWARD:
        return shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=key, zero_grad=bool(flags & ZERO_GRAD)))
    try:
        text = str(name, "utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"local link: a packed {kind} item's name is not UTF-8") from None
    return shard_pb2.LinkMessage(**{kind: shard_pb2.TensorKey(key=key, name=text)})


def _tensor(kind: str, flags: int, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int,
            rest: memoryview) -> torch.Tensor:
    numel = 1
    for dim in shape:
        if dim < 0:
            raise InvalidArgument(f"local link: a packed {kind} item's tensor has a negative dimension in "
                                  f"{list(shape)}")
        numel *= dim
    if nbytes != numel * dtype.itemsize:
        raise InvalidArgument(f"local link: a packed {kind} item says {nbytes} bytes but shape {list(shape)} of "
                              f"{dtype} needs {numel * dtype.itemsize}")
    if flags & SHARED:
        if len(rest) != _SEGMENT.size:
            raise DataLoss(f"local link: a packed {kind} item's segment handle is {len(rest)} bytes, not "
                           f"{_SEGMENT.size}")
        buffer = shm.open_numbered(*_SEGMENT.unpack(rest), nbytes)
    elif len(rest) != nbytes:
        raise DataLoss(f"local link: a packed {kind} item says {nbytes} bytes of tensor but carries {len(rest)}")
    elif nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    else:
        buffer = torch.frombuffer(bytearray(rest), dtype=torch.uint8)
    return buffer.view(dtype).reshape(shape)
