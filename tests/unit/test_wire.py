"""shardtrain.wire: tensors to header + data chunks and back, and every way a chunk stream can be wrong."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shardtrain import wire
from shardtrain.errors import DataLoss, InvalidArgument
from shardtrain.v1 import shard_pb2, tensor_pb2

WIRE_CODES = [
    (torch.float32, tensor_pb2.DTYPE_FLOAT32),
    (torch.float64, tensor_pb2.DTYPE_FLOAT64),
    (torch.float16, tensor_pb2.DTYPE_FLOAT16),
    (torch.bfloat16, tensor_pb2.DTYPE_BFLOAT16),
    (torch.int64, tensor_pb2.DTYPE_INT64),
    (torch.int32, tensor_pb2.DTYPE_INT32),
    (torch.int16, tensor_pb2.DTYPE_INT16),
    (torch.int8, tensor_pb2.DTYPE_INT8),
    (torch.uint8, tensor_pb2.DTYPE_UINT8),
    (torch.bool, tensor_pb2.DTYPE_BOOL),
]
DTYPES = [dtype for dtype, _ in WIRE_CODES]


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    """Values that exercise the whole range of a dtype, special floats included."""
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        values = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
        values.view(-1)[:4] = torch.tensor([float("inf"), float("-inf"), -0.0, float("nan")]).to(dtype)
        return values
    info = torch.iinfo(dtype)
    values = torch.randint(info.min, info.max, shape, generator=generator, dtype=dtype)
    values.view(-1)[:2] = torch.tensor([info.min, info.max], dtype=dtype)
    return values


def round_trip(tensor: torch.Tensor, chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES, name: str = "t") -> torch.Tensor:
    received = list(wire.read_tensors(wire.tensor_chunks(tensor, name, chunk_bytes)))
    assert [n for n, _ in received] == [name]
    return received[0][1]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality, NaN and -0.0 included: dtype, shape and bytes."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def header_chunk(dtype=tensor_pb2.DTYPE_FLOAT32, shape=(2,), nbytes=8, data=b"", name="t") -> tensor_pb2.TensorChunk:
    return tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(name=name, dtype=dtype, shape=shape, nbytes=nbytes),
                                  data=data)


def data_chunk(data: bytes) -> tensor_pb2.TensorChunk:
    return tensor_pb2.TensorChunk(data=data)


@pytest.mark.parametrize(("dtype", "code"), WIRE_CODES)
def test_dtype_table_maps_both_ways(dtype, code):
    assert wire.dtype_code(dtype) == code
    assert wire.torch_dtype(code) == dtype


def test_dtype_outside_the_table_cannot_be_sent():
    with pytest.raises(InvalidArgument, match="complex64"):
        list(wire.tensor_chunks(torch.zeros(2, dtype=torch.complex64)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_exact_for_every_dtype(dtype):
    original = sample(dtype)
    assert same_bits(round_trip(original), original)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_exact_when_chunks_split_elements(dtype):
    original = sample(dtype, shape=(7, 3))
    assert same_bits(round_trip(original, chunk_bytes=5), original)


def test_non_contiguous_tensor_arrives_in_logical_order():
    original = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()[::2]
    assert not original.is_contiguous()
    received = round_trip(original, chunk_bytes=12)
    assert received.shape == (3, 4)
    assert torch.equal(received, original)


def test_zero_element_tensor_is_one_header_only_chunk():
    chunks = list(wire.tensor_chunks(torch.zeros(0, 3), "empty"))
    assert len(chunks) == 1
    assert chunks[0].header.nbytes == 0 and list(chunks[0].header.shape) == [0, 3]
    assert chunks[0].data == b""
    assert round_trip(torch.zeros(0, 3)).shape == (0, 3)


def test_zero_dim_scalar_keeps_its_empty_shape():
    received = round_trip(torch.tensor(3.5, dtype=torch.float64))
    assert received.shape == ()
    assert received.item() == 3.5


def test_header_describes_the_tensor():
    chunks = list(wire.tensor_chunks(torch.zeros(2, 3, dtype=torch.int16), "activation"))
    header = chunks[0].header
    assert (header.name, header.dtype, list(header.shape), header.nbytes) == (
        "activation", tensor_pb2.DTYPE_INT16, [2, 3], 12)


def test_chunk_smaller_than_tensor_splits_data_and_only_first_has_header():
    chunks = list(wire.tensor_chunks(torch.arange(10, dtype=torch.float32), "t", chunk_bytes=16))
    assert [len(c.data) for c in chunks] == [16, 16, 8]
    assert [c.HasField("header") for c in chunks] == [True, False, False]


def test_exact_multiple_of_chunk_size_has_no_trailing_empty_chunk():
    original = torch.arange(10, dtype=torch.float32)
    chunks = list(wire.tensor_chunks(original, "t", chunk_bytes=8))
    assert [len(c.data) for c in chunks] == [8] * 5
    assert torch.equal(round_trip(original, chunk_bytes=8), original)


def test_gradient_tracking_tensor_is_sent_detached():
    original = torch.randn(3, requires_grad=True)
    received = round_trip(original * 2)
    assert not received.requires_grad
    assert torch.equal(received, (original * 2).detach())


def test_read_tensors_yields_each_tensor_of_a_stream_in_order():
    a, b = torch.arange(6, dtype=torch.int64), torch.ones(2, 2, dtype=torch.bool)
    chunks = [*wire.tensor_chunks(a, "a", chunk_bytes=16), *wire.tensor_chunks(b, "b", chunk_bytes=16)]
    received = list(wire.read_tensors(chunks))
    assert [name for name, _ in received] == ["a", "b"]
    assert torch.equal(received[0][1], a) and torch.equal(received[1][1], b)


def test_received_tensor_does_not_alias_the_sender():
    original = torch.zeros(4)
    received = round_trip(original)
    original.add_(1)
    assert torch.equal(received, torch.zeros(4))


# framed(): a request stream whose first message carries the request header.

def test_framed_puts_header_on_first_message_only():
    header = shard_pb2.LoadStateHeader(deployment_id="d1")
    tensors = {"0.weight": torch.zeros(4), "0.bias": torch.ones(2)}
    messages = list(wire.framed(shard_pb2.LoadStateRequest, header, tensors, chunk_bytes=8))
    assert [m.HasField("header") for m in messages] == [True, False, False]
    assert messages[0].header.deployment_id == "d1"
    assert all(m.HasField("tensor") for m in messages)
    received = dict(wire.read_tensors(m.tensor for m in messages))
    assert set(received) == {"0.weight", "0.bias"}
    assert torch.equal(received["0.bias"], torch.ones(2))


def test_framed_without_tensors_yields_one_header_only_message():
    header = shard_pb2.LoadStateHeader(deployment_id="d1")
    messages = list(wire.framed(shard_pb2.LoadStateRequest, header, {}))
    assert len(messages) == 1
    assert messages[0].header.deployment_id == "d1"
    assert not messages[0].HasField("tensor")


# TensorStreamReader: malformed streams.

def test_data_before_any_header_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="data chunk before any header"):
        wire.TensorStreamReader().feed(data_chunk(b"\0" * 4))


def test_data_beyond_announced_size_is_data_loss():
    reader = wire.TensorStreamReader()
    reader.feed(header_chunk(shape=(2,), nbytes=8, data=b"\0" * 4))
    with pytest.raises(DataLoss, match=r"'t'.*received 12 bytes, header announced 8"):
        reader.feed(data_chunk(b"\0" * 8))


def test_overrun_in_the_header_chunk_itself_is_data_loss():
    with pytest.raises(DataLoss, match="header announced 8"):
        wire.TensorStreamReader().feed(header_chunk(shape=(2,), nbytes=8, data=b"\0" * 9))


def test_second_header_before_first_tensor_is_complete_is_data_loss():
    reader = wire.TensorStreamReader()
    reader.feed(header_chunk(name="first", data=b"\0" * 4))
    with pytest.raises(DataLoss, match="'first'.*new header"):
        reader.feed(header_chunk(name="second"))


def test_stream_ending_mid_tensor_is_data_loss_at_finish():
    reader = wire.TensorStreamReader()
    assert reader.feed(header_chunk(shape=(2,), nbytes=8, data=b"\0" * 4)) is None
    with pytest.raises(DataLoss, match=r"'t'.*after 4 of 8 bytes"):
        reader.finish()


def test_read_tensors_reports_a_truncated_stream():
    chunks = list(wire.tensor_chunks(torch.zeros(10), "t", chunk_bytes=16))
    with pytest.raises(DataLoss, match="after 32 of 40 bytes"):
        list(wire.read_tensors(chunks[:-1]))


def test_finish_after_complete_tensors_is_quiet():
    reader = wire.TensorStreamReader()
    assert reader.feed(header_chunk(shape=(2,), nbytes=8, data=b"\0" * 8))[0] == "t"
    reader.finish()


def test_nbytes_disagreeing_with_shape_is_invalid_argument():
    with pytest.raises(InvalidArgument, match=r"header says 12 bytes but shape \[2, 2\] of torch.float32 needs 16"):
        wire.TensorStreamReader().feed(header_chunk(shape=(2, 2), nbytes=12))


def test_negative_dimension_is_invalid_argument():
    with pytest.raises(InvalidArgument, match=r"negative dimension in shape \[2, -2\]"):
        wire.TensorStreamReader().feed(header_chunk(shape=(2, -2), nbytes=16))


def test_unknown_dtype_code_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="unknown dtype code 99"):
        wire.TensorStreamReader().feed(header_chunk(dtype=99))


def test_unspecified_dtype_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="unknown dtype code 0"):
        wire.TensorStreamReader().feed(header_chunk(dtype=tensor_pb2.DTYPE_UNSPECIFIED))


def test_tensor_above_max_bytes_is_refused_before_allocation():
    reader = wire.TensorStreamReader(max_bytes=16)
    with pytest.raises(InvalidArgument, match="20 bytes exceeds the limit of 16"):
        reader.feed(header_chunk(shape=(5,), nbytes=20))


def test_huge_announced_tensor_is_refused_by_the_default_limit():
    shape = (1 << 20, 1 << 20, 1 << 10)  # 2**50 float32 elements: far over MAX_TENSOR_BYTES
    with pytest.raises(InvalidArgument, match="exceeds the limit"):
        wire.TensorStreamReader().feed(header_chunk(shape=shape, nbytes=4 << 50))


def test_tensor_at_max_bytes_is_accepted():
    reader = wire.TensorStreamReader(max_bytes=16)
    name, tensor = reader.feed(header_chunk(shape=(4,), nbytes=16, data=b"\0" * 16))
    assert tensor.shape == (4,)


# collect(): the async form used by servicers.

async def as_stream(chunks):
    for chunk in chunks:
        await asyncio.sleep(0)
        yield chunk


def test_collect_gathers_every_tensor_of_an_async_stream_by_name():
    a, b = torch.randn(3, 4), torch.arange(5, dtype=torch.int32)
    chunks = [*wire.tensor_chunks(a, "a", chunk_bytes=10), *wire.tensor_chunks(b, "b", chunk_bytes=10)]
    tensors = asyncio.run(wire.collect(as_stream(chunks)))
    assert set(tensors) == {"a", "b"}
    assert torch.equal(tensors["a"], a) and torch.equal(tensors["b"], b)


def test_collect_of_empty_stream_is_empty():
    assert asyncio.run(wire.collect(as_stream([]))) == {}


def test_collect_reports_a_truncated_stream():
    chunks = list(wire.tensor_chunks(torch.zeros(4), "t", chunk_bytes=8))
    with pytest.raises(DataLoss, match="'t'"):
        asyncio.run(wire.collect(as_stream(chunks[:1])))
