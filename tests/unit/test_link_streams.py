"""shardtrain.link_streams: a Link's items survive the wire whole, in order, and a broken sequence is refused."""

from __future__ import annotations

import pytest
import torch

from shardtrain import errors, link_streams, wire
from shardtrain.codec import Codec
from shardtrain.v1 import shard_pb2

CODEC = Codec(shard_pb2.LinkMessage)
KEY = shard_pb2.StepKey(deployment_id="d", step=3, microbatch=1)


def over_the_wire(frames):
    """Each frame as the peer's deserializer hands it over (real serialized bytes)."""
    return [CODEC.deserialize(CODEC.serialize(frame)) for frame in frames]


def read_all(frames) -> list[link_streams.Item]:
    reader = link_streams.ItemReader()
    return [item for item in (reader.feed(frame) for frame in over_the_wire(frames)) if item is not None]


def test_items_with_and_without_tensors_arrive_in_order_and_whole():
    activation = torch.randn(64, 33)  # 8448 bytes: nine chunks of 1000 bytes
    options = wire.SendOptions(chunk_bytes=1000)
    step = shard_pb2.LinkStep(request=shard_pb2.StepRequest(optimizer_step=2))
    frames = [*link_streams.frames(shard_pb2.LinkMessage(step=step)),
              *link_streams.frames(shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader(key=KEY)), activation,
                                   options),
              *link_streams.frames(shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=KEY)))]
    assert len(frames) == 11
    items = read_all(frames)
    assert [message.WhichOneof("item") for message, _ in items] == ["step", "forward", "backward"]
    assert items[0][1] is None and items[2][1] is None
    assert items[1][0].forward.key == KEY and not items[1][0].HasField("tensor")
    assert torch.equal(items[1][1], activation)


def test_a_tensor_item_is_not_complete_until_its_last_chunk():
    frames = list(link_streams.frames(shard_pb2.LinkMessage(residual=shard_pb2.TensorKey(key=KEY, name="r")),
                                      torch.arange(600, dtype=torch.int32), wire.SendOptions(chunk_bytes=1024)))
    reader = link_streams.ItemReader()
    received = over_the_wire(frames)
    assert [reader.feed(frame) for frame in received[:-1]] == [None, None]
    message, tensor = reader.feed(received[-1])
    assert message.residual.name == "r" and torch.equal(tensor, torch.arange(600, dtype=torch.int32))


def test_a_new_item_inside_an_unfinished_tensor_is_data_loss():
    frames = list(link_streams.frames(shard_pb2.LinkMessage(output=shard_pb2.TensorKey(key=KEY)), torch.zeros(1000),
                                      wire.SendOptions(chunk_bytes=1024)))
    intruder = next(link_streams.frames(shard_pb2.LinkMessage(step=shard_pb2.LinkStep())))
    with pytest.raises(errors.DataLoss, match="a step item arrived before the tensor of the previous output item"):
        read_all([frames[0], intruder])


def test_a_chunk_outside_any_item_is_refused():
    stray = list(link_streams.frames(shard_pb2.LinkMessage(output=shard_pb2.TensorKey(key=KEY)), torch.zeros(1000),
                                     wire.SendOptions(chunk_bytes=1024)))[1]
    with pytest.raises(errors.InvalidArgument, match="tensor chunk arrived outside any item"):
        read_all([stray])


def test_error_items_keep_code_and_place_and_raise_as_the_same_error():
    item = link_streams.error_item(KEY, errors.InvalidArgument("bad shape"), "shard 127.0.0.1:1 (stage 2)",
                                   backward=True)
    assert item.error.key == KEY and item.error.backward
    raised = link_streams.raised(item.error)
    assert isinstance(raised, errors.InvalidArgument)
    assert str(raised) == "shard 127.0.0.1:1 (stage 2): bad shape"
    passed_on = link_streams.error_item(None, raised, "shard 127.0.0.1:2 (stage 1)")
    assert passed_on.error.message == "shard 127.0.0.1:1 (stage 2): bad shape", "a peer's error keeps its place"
    assert not passed_on.error.HasField("key")


def test_unexpected_exceptions_become_internal_errors_naming_the_place():
    item = link_streams.error_item(KEY, KeyError("x"), "shard a (stage 0)")
    assert item.error.code == "INTERNAL" and item.error.message == "shard a (stage 0): unexpected KeyError: 'x'"
