"""enums.check: any enum value its enum does not define, however deep in a message, is named with the values
the enum has."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from shardtrain import enums, errors
from shardtrain.v1 import shard_pb2, tensor_pb2


def test_every_in_range_value_passes():
    enums.check(shard_pb2.LinkMessage(open=shard_pb2.LinkOpen(role=shard_pb2.LINK_ROLE_TIED)))
    enums.check(shard_pb2.LinkMessage(tensor=tensor_pb2.TensorChunk(
        header=tensor_pb2.TensorHeader(dtype=tensor_pb2.DTYPE_BOOL, encoding=tensor_pb2.ENCODING_INT8_BLOCKWISE))))
    enums.check(shard_pb2.DescribeRequest())  # no enum anywhere in it


@pytest.mark.parametrize("message, expected", [
    (shard_pb2.LinkMessage(open=shard_pb2.LinkOpen(role=9)),
     "LinkMessage.open.role is 9, which is no LinkRole; expected one of LINK_ROLE_UNSPECIFIED (0), "
     "LINK_ROLE_INPUT (1), LINK_ROLE_OUTPUT (2), LINK_ROLE_NEXT (3), LINK_ROLE_RESIDUAL (4), LINK_ROLE_TIED (5)"),
    (shard_pb2.ProfileLayersRequest(layers=[shard_pb2.CapturedLayer(
        example_inputs=[shard_pb2.TensorSpec(dtype=1), shard_pb2.TensorSpec(dtype=-3)])]),
     "ProfileLayersRequest.layers[0].example_inputs[1].dtype is -3, which is no DType; expected one of "
     "DTYPE_UNSPECIFIED (0), DTYPE_FLOAT32 (1)"),
    (shard_pb2.LoadStageRequest(encodings=tensor_pb2.WireEncodings(residuals=77)),
     "LoadStageRequest.encodings.residuals is 77, which is no Encoding"),
    (shard_pb2.LinkMessage(flush=shard_pb2.Flush(stage_stats=[shard_pb2.StageStats(
        spans=[shard_pb2.WorkSpan(kind=2), shard_pb2.WorkSpan(kind=12)])])),
     "LinkMessage.flush.stage_stats[0].spans[1].kind is 12, which is no WorkKind"),
])
def test_an_out_of_range_value_is_named_with_its_path_and_the_values_allowed(message, expected):
    with pytest.raises(errors.InvalidArgument) as caught:
        enums.check(message)
    assert str(caught.value).startswith(expected), str(caught.value)


def test_map_values_and_messages_that_contain_themselves_are_checked():
    """The contract has neither today; a message type that does is still walked, not crashed on."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(tensor_pb2.DESCRIPTOR.serialized_pb))
    pool.Add(descriptor_pb2.FileDescriptorProto(
        name="tree.proto", package="test", dependency=["shardtrain/v1/tensor.proto"], syntax="proto3",
        message_type=[descriptor_pb2.DescriptorProto(name="Tree", field=[
            _field("dtypes", 1, _MESSAGE, ".test.Tree.DtypesEntry", repeated=True),
            _field("children", 2, _MESSAGE, ".test.Tree", repeated=True),
        ], nested_type=[descriptor_pb2.DescriptorProto(
            name="DtypesEntry", options=descriptor_pb2.MessageOptions(map_entry=True), field=[
                _field("key", 1, _STRING),
                _field("value", 2, _ENUM, ".shardtrain.v1.DType")])])]))
    tree = message_factory.GetMessageClass(pool.FindMessageTypeByName("test.Tree"))()
    tree.children.add().children.add().dtypes["weight"] = 1
    enums.check(tree)
    tree.children[0].children[0].dtypes["bias"] = 99
    with pytest.raises(errors.InvalidArgument, match=r"Tree.children\[0\].children\[0\].dtypes\['bias'\] is 99, "
                                                     r"which is no DType"):
        enums.check(tree)


_FIELD = descriptor_pb2.FieldDescriptorProto
_ENUM, _MESSAGE, _STRING = _FIELD.TYPE_ENUM, _FIELD.TYPE_MESSAGE, _FIELD.TYPE_STRING


def _field(name: str, number: int, kind: int, type_name: str | None = None, repeated: bool = False):
    label = _FIELD.LABEL_REPEATED if repeated else _FIELD.LABEL_OPTIONAL
    return _FIELD(name=name, number=number, type=kind, label=label, **({"type_name": type_name} if type_name else {}))
