"""shardtrain.codec: Frames on the wire are plain protobuf, and plain protobuf parses as Frames."""

from __future__ import annotations

import pytest

from shardtrain.codec import Codec, Frame, carries_chunks
from shardtrain.v1 import shard_pb2, tensor_pb2

DATA = bytes(range(256)) * 5


def forward_frame(data: bytes = DATA) -> Frame:
    header = shard_pb2.ForwardHeader(key=shard_pb2.StepKey(deployment_id="d", step=7))
    chunk = tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(name="activation", shape=[len(data)]),
                                   offset=0, crc32=123)
    return Frame(shard_pb2.ForwardRequest(header=header, tensor=chunk), memoryview(data))


def test_frame_bytes_parse_as_the_message_with_its_data_set():
    frame = forward_frame()
    parsed = shard_pb2.ForwardRequest.FromString(Codec(shard_pb2.ForwardRequest).serialize(frame))
    expected = shard_pb2.ForwardRequest()
    expected.CopyFrom(frame.message)
    expected.tensor.data = DATA
    assert parsed == expected


def test_bare_chunk_frame_parses_as_a_chunk_with_its_data():
    chunk = tensor_pb2.TensorChunk(offset=4096, crc32=9)
    raw = Codec(tensor_pb2.TensorChunk).serialize(Frame(chunk, b"abc"))
    assert tensor_pb2.TensorChunk.FromString(raw) == tensor_pb2.TensorChunk(offset=4096, crc32=9, data=b"abc")


@pytest.mark.parametrize("message_type", [shard_pb2.ForwardRequest, tensor_pb2.TensorChunk])
def test_round_trip_gives_the_message_and_a_view_of_the_data(message_type):
    frame = forward_frame() if message_type is shard_pb2.ForwardRequest else Frame(
        tensor_pb2.TensorChunk(offset=3, crc32=1), memoryview(DATA))
    codec = Codec(message_type)
    received = codec.deserialize(codec.serialize(frame))
    assert isinstance(received.data, memoryview)  # not copied out of the received buffer
    assert bytes(received.data) == DATA
    assert received.message == frame.message
    assert received.chunk.data == b""


def test_plainly_serialized_message_from_another_client_is_understood():
    message = shard_pb2.ForwardRequest()
    message.CopyFrom(forward_frame().message)
    message.tensor.data = DATA
    received = Codec(shard_pb2.ForwardRequest).deserialize(message.SerializeToString())
    assert bytes(received.data) == DATA
    assert received.chunk.header.name == "activation"
    assert received.chunk.data == b""


def test_data_in_the_middle_of_the_message_is_understood():
    # Field order is free in protobuf: data first, then offset and crc32.
    raw = tensor_pb2.TensorChunk(data=b"xyz").SerializeToString() + \
        tensor_pb2.TensorChunk(offset=5, crc32=6).SerializeToString()
    received = Codec(tensor_pb2.TensorChunk).deserialize(raw)
    assert (bytes(received.data), received.chunk.offset, received.chunk.crc32) == (b"xyz", 5, 6)


def test_message_without_tensor_has_no_chunk_and_no_data():
    codec = Codec(shard_pb2.ForwardRequest)
    message = shard_pb2.ForwardRequest(header=shard_pb2.ForwardHeader(requires_grad=True))
    received = codec.deserialize(codec.serialize(Frame(message)))
    assert received.chunk is None and bytes(received.data) == b""
    assert received.message == message


def test_empty_data_serializes_as_the_message_alone():
    frame = forward_frame(b"")
    assert Codec(shard_pb2.ForwardRequest).serialize(frame) == frame.message.SerializeToString()


def test_plain_messages_pass_through_the_serializer():
    message = shard_pb2.ForwardRequest(header=shard_pb2.ForwardHeader(zero_grad=True))
    assert Codec(shard_pb2.ForwardRequest).serialize(message) == message.SerializeToString()


def test_garbage_is_a_parse_error_not_a_wrong_frame():
    with pytest.raises(Exception):
        Codec(shard_pb2.ForwardRequest).deserialize(b"\x12\xff\xff\xff\xff\x0f")


@pytest.mark.parametrize(("message_type", "carries"), [
    (tensor_pb2.TensorChunk, True), (shard_pb2.ForwardRequest, True), (shard_pb2.LoadStateRequest, True),
    (shard_pb2.StepRequest, False), (shard_pb2.FetchTensorRequest, False)])
def test_which_types_travel_as_frames(message_type, carries):
    assert carries_chunks(message_type) is carries
