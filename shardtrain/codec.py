"""gRPC serializers for messages that carry a TensorChunk: its data never passes through protobuf.

A protobuf `bytes` field costs a copy when set, another when the message is serialized, and two
more when a received message is parsed and the field read. Here a Frame keeps the chunk's data
beside the message instead: the serializer appends it to the serialized message in one join, and
the deserializer hands it on as a view of the received buffer. The bytes on the wire stay plain
protobuf that any language parses: the data goes out as a second occurrence of the chunk field,
holding only `data`, which protobuf merges into the first (its rule for repeated embedded
messages). A message that arrives another way (data not last) is parsed the ordinary way.
`python -m bench.transport` compares this with a plain protobuf field (docs/performance.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from shardtrain.v1 import tensor_pb2

_LENGTH_DELIMITED = 2
_DATA_FIELD = tensor_pb2.TensorChunk.DESCRIPTOR.fields_by_name["data"].number


@dataclass(slots=True)
class Frame:
    """A message and the data of the TensorChunk inside it, kept apart so protobuf never copies it."""

    message: Any
    data: Any = b""  # bytes-like: a view of the sender's tensor, or of the received buffer

    @property
    def chunk(self) -> tensor_pb2.TensorChunk | None:
        """The TensorChunk inside the message (the message itself for a bare chunk), if it has one."""
        return _chunk_of(self.message)


def _chunk_of(message: Any) -> tensor_pb2.TensorChunk | None:
    if isinstance(message, tensor_pb2.TensorChunk):
        return message
    field = _chunk_field(type(message))
    if field is None or not message.HasField(field.name):
        return None
    return getattr(message, field.name)


@functools.cache  # per message type: every frame asks, sent or received
def _chunk_field(message_type: type) -> Any:
    for field in message_type.DESCRIPTOR.fields:
        if field.message_type is tensor_pb2.TensorChunk.DESCRIPTOR:
            return field
    return None


def carries_chunks(message_type: type) -> bool:
    """Whether messages of this type carry tensor data, so they travel as Frames."""
    return message_type is tensor_pb2.TensorChunk or _chunk_field(message_type) is not None


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buffer: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(buffer) or shift > 63:
            raise ValueError("truncated or oversized varint")
        byte = buffer[position]
        value |= (byte & 0x7F) << shift
        position, shift = position + 1, shift + 7
        if byte < 0x80:
            return value, position


def _skip(buffer: memoryview, position: int, wire_type: int) -> int:
    """The position after a field's value that starts at `position`."""
    if wire_type == 0:
        return _read_varint(buffer, position)[1]
    if wire_type == 1:
        return position + 8
    if wire_type == 5:
        return position + 4
    if wire_type == _LENGTH_DELIMITED:
        length, position = _read_varint(buffer, position)
        return position + length
    raise ValueError(f"unsupported wire type {wire_type}")


def _last_field(buffer: memoryview) -> tuple[int, int, int, int]:
    """(start, field number, wire type, value start) of the last top-level field of a serialized message."""
    position, last = 0, (0, 0, 0, 0)
    while position < len(buffer):
        start = position
        tag, position = _read_varint(buffer, position)
        last = (start, tag >> 3, tag & 7, position)
        position = _skip(buffer, position, tag & 7)
    if position != len(buffer):
        raise ValueError("a field runs past the end of the message")
    return last


class Codec:
    """Serializer and deserializer of one message type that carries a TensorChunk."""

    def __init__(self, message_type: type):
        self.message_type = message_type
        field = None if message_type is tensor_pb2.TensorChunk else _chunk_field(message_type)
        self._chunk_number = field.number if field is not None else None

    def serialize(self, item: Frame | Any) -> bytes:
        """The message's bytes with the frame's data appended as a trailing chunk field."""
        if not isinstance(item, Frame):
            return item.SerializeToString()
        head = item.message.SerializeToString()
        size = len(item.data)
        if size == 0:
            return head
        data_prefix = _varint(_DATA_FIELD << 3 | _LENGTH_DELIMITED) + _varint(size)
        if self._chunk_number is None:
            return b"".join((head, data_prefix, item.data))
        chunk_prefix = _varint(self._chunk_number << 3 | _LENGTH_DELIMITED) + _varint(len(data_prefix) + size)
        return b"".join((head, chunk_prefix, data_prefix, item.data))

    def deserialize(self, raw: bytes) -> Frame:
        """A Frame whose data is a view of `raw` when the data came last, as shardtrain writes it."""
        view = memoryview(raw)
        try:
            split = self._data_position(view)
        except ValueError:
            split = None
        if split is None:
            return self._parse_plainly(raw)
        head_end, data_start = split
        frame = Frame(self.message_type.FromString(raw[:head_end]), view[data_start:])
        chunk = frame.chunk
        if chunk is None:  # the trailing field was all there was of the chunk
            chunk = getattr(frame.message, _chunk_field(self.message_type).name)
            chunk.SetInParent()
        chunk.ClearField("data")  # an earlier occurrence, overridden by the trailing one
        return frame

    def _data_position(self, view: memoryview) -> tuple[int, int] | None:
        """(end of the head, start of the data) when the message ends with the data field, else None."""
        start, number, wire_type, value = _last_field(view)
        if wire_type != _LENGTH_DELIMITED:
            return None
        if self._chunk_number is None:
            return (start, _read_varint(view, value)[1]) if number == _DATA_FIELD else None
        if number != self._chunk_number:
            return None
        inner_length, inner_start = _read_varint(view, value)
        tag, data_length_at = _read_varint(view, inner_start)
        if tag != (_DATA_FIELD << 3 | _LENGTH_DELIMITED):
            return None
        length, data_start = _read_varint(view, data_length_at)
        return (start, data_start) if data_start + length == len(view) else None

    def _parse_plainly(self, raw: bytes) -> Frame:
        frame = Frame(self.message_type.FromString(raw))
        chunk = frame.chunk
        if chunk is not None:
            frame.data = chunk.data
            chunk.ClearField("data")
        return frame
