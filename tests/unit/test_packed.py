"""shardtrain.packed: frequent Link items survive packing exactly; the rest stay LinkMessages; bad bytes are refused."""

from __future__ import annotations

import gc
import struct

import pytest
import torch

from shardtrain import carrier, packed, shm, wire
from shardtrain.errors import DataLoss, InvalidArgument
from shardtrain.v1 import shard_pb2

KEY = shard_pb2.StepKey(deployment_id="d", step=12, microbatch=3)
FORWARD = shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader(
    key=KEY, requires_grad=True, zero_grad=True, after_optimizer_step=11, input_requires_grad=True, eval_mode=True))
ITEMS = {
    "forward": FORWARD,
    "backward": shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=KEY)),
    "backward zeroing first": shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=KEY, zero_grad=True)),
    "residual": shard_pb2.LinkMessage(residual=shard_pb2.TensorKey(key=KEY, name="res_1 ü")),
    "residual_gradient": shard_pb2.LinkMessage(residual_gradient=shard_pb2.TensorKey(key=KEY, name="x")),
    "output": shard_pb2.LinkMessage(output=shard_pb2.TensorKey(key=KEY)),
    "backward_done": shard_pb2.LinkMessage(backward_done=shard_pb2.TensorKey(key=KEY)),
}


@pytest.fixture
def segments():
    pool = shm.SegmentPool(max_segments=2) if shm.available() else None
    yield pool
    if pool is not None:
        pool.close()


def through(message, tensor, options=wire.EXACT, deployment_id="d"):
    """Packs an item, cuts it as the carrier does, and unpacks it."""
    head, data = packed.pack(message, tensor, options, deployment_id)
    body = memoryview(bytes(head) + bytes(data))
    frame = carrier.decode(body)
    assert type(frame) is packed.PackedFrame
    return packed.unpack(frame.body, deployment_id)


@pytest.mark.parametrize("kind", sorted(ITEMS))
@pytest.mark.parametrize("tensor", [None, torch.randn(4, 5), torch.arange(6, dtype=torch.int64).reshape(1, 2, 3),
                                    torch.tensor(2.5), torch.empty(0, 7), torch.ones(3, dtype=torch.bool)],
                         ids=["none", "float", "int64 3d", "scalar", "empty", "bool"])
def test_every_frequent_item_comes_back_as_sent(kind, tensor):
    message, received = through(ITEMS[kind], tensor)
    assert message == ITEMS[kind]
    if tensor is None:
        assert received is None
    else:
        assert received.dtype == tensor.dtype and received.shape == tensor.shape and torch.equal(received, tensor)


@pytest.mark.parametrize("header, item, unpacked", [
    (shard_pb2.ForwardHeader, FORWARD.forward, {"plan", "step_first"}),
    (shard_pb2.BackwardHeader, ITEMS["backward zeroing first"].backward, set())])
def test_the_items_above_set_every_field_a_packed_forward_or_backward_carries(header, item, unpacked):
    """A field added to ForwardHeader or BackwardHeader is either packed (and set above, so the round trip checks
    it) or makes the item go as a LinkMessage, as `plan` and `step_first` do."""
    fields = {field.name for field in header.DESCRIPTOR.fields}
    assert {field.name for field, _ in item.ListFields()} == fields - unpacked


@pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")
def test_a_big_tensor_goes_by_shared_segment_and_the_segment_comes_back_free(segments):
    tensor = torch.randn(64, 1024)  # 256 KiB: over shm.MIN_BYTES
    head, data = packed.pack(FORWARD, tensor, wire.SendOptions(segments=segments), "d")
    assert data == b"" and len(head) < 100  # the handle, not the bytes
    message, received = packed.unpack(memoryview(head)[4:], "d")
    assert message == FORWARD and torch.equal(received, tensor)
    before = segments._segments[0]
    assert not before.is_free()
    del received
    gc.collect()
    assert before.is_free()


def test_a_strided_tensor_is_sent_as_its_contiguous_values():
    tensor = torch.randn(6, 4).t()
    _, received = through(FORWARD, tensor)
    assert torch.equal(received, tensor)


@pytest.mark.parametrize("message", [
    shard_pb2.LinkMessage(step=shard_pb2.LinkStep()),
    shard_pb2.LinkMessage(flush=shard_pb2.Flush(optimizer_step=1)),
    shard_pb2.LinkMessage(error=shard_pb2.LinkError(code="INTERNAL")),
    shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader(key=KEY, plan=shard_pb2.StepPlan(microbatches=2))),
    shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader(key=KEY, step_first=shard_pb2.StepRequest())),
    shard_pb2.LinkMessage(output=shard_pb2.TensorKey(key=shard_pb2.StepKey(deployment_id="other"))),
], ids=["step", "flush", "error", "planned forward", "step_first", "other deployment"])
def test_other_items_stay_link_messages(message):
    assert packed.pack(message, None, wire.EXACT, "d") is None


def test_tensors_packing_cannot_carry_exactly_stay_link_messages():
    assert packed.pack(FORWARD, torch.zeros([1] * (packed.MAX_DIMS + 1)), wire.EXACT, "d") is None
    lossy = wire.SendOptions(encoding=wire.encoding_code("fp16"))
    assert packed.pack(FORWARD, torch.randn(3), lossy, "d") is None
    assert packed.pack(FORWARD, torch.arange(3), lossy, "d") is not None  # fp16 leaves integers alone


def test_a_dtype_the_wire_does_not_carry_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="cannot be sent"):
        packed.pack(FORWARD, torch.zeros(2, dtype=torch.complex64), wire.EXACT, "d")


def raw(kind=packed.FORWARD, flags=packed.TENSOR, dtype=1, shape=(2,), nbytes=8, name=b"", rest=b"\0" * 8) -> bytes:
    head = struct.pack(f"<BBBBHiqqq{len(shape)}q", kind, flags, dtype, len(shape), len(name), 0, 1, 0, nbytes, *shape)
    return head + name + rest


@pytest.mark.parametrize(("body", "error", "match"), [
    (b"\x02\x01", DataLoss, "shorter than its"),
    (raw(kind=1), InvalidArgument, "kind 1 is none of"),
    (raw(shape=(1,) * 9, nbytes=4, rest=b"\0" * 4), InvalidArgument, "9 dimensions"),
    (raw(name=b"ab", rest=b"")[:-1], DataLoss, "ends inside its header"),
    (raw(shape=(3,)), InvalidArgument, "says 8 bytes but shape \\[3\\]"),
    (raw(shape=(-2,), nbytes=8), InvalidArgument, "negative dimension"),
    (raw(rest=b"\0" * 7), DataLoss, "carries 7"),
    (raw(flags=0, shape=(), nbytes=0, rest=b"x"), DataLoss, "without a tensor carries 1 bytes"),
    (raw(flags=packed.TENSOR | packed.SHARED, rest=b"\0" * 5), DataLoss, "segment handle is 5 bytes"),
    (raw(dtype=99), InvalidArgument, "unknown dtype code 99"),
    (raw(kind=packed._NUMBERS["residual"], name=b"\xff"), InvalidArgument, "not UTF-8"),
], ids=["short", "kind", "dims", "cut name", "size", "negative", "data", "stray data", "handle", "dtype", "name"])
def test_a_malformed_packed_item_is_refused_with_what_was_wrong(body, error, match):
    with pytest.raises(error, match=match):
        packed.unpack(memoryview(body), "d")


@pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")
def test_a_handle_to_a_segment_that_is_not_there_is_data_loss():
    body = raw(flags=packed.TENSOR | packed.SHARED, shape=(16384,), nbytes=65536, rest=struct.pack("<IQq", 1, 2, 3))
    with pytest.raises(DataLoss, match="cannot be opened"):
        packed.unpack(memoryview(body), "d")
