"""shardtrain.wire: tensors to header + data chunks and back, and every way a chunk stream can be wrong."""

from __future__ import annotations

import asyncio
import pathlib
import zlib

import pytest
import torch

from shardtrain import checksums, shm, wire
from shardtrain.codec import Codec, Frame
from shardtrain.errors import DataLoss, FailedPrecondition, InvalidArgument, ResourceExhausted
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


CHUNK_CODEC = Codec(tensor_pb2.TensorChunk)


def tensor_frames(tensor: torch.Tensor, name: str = "", chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
                  checksum: str = "off") -> list[Frame]:
    """The frames of a tensor as a receiver sees them: serialized and parsed by the codec, as on the wire."""
    sent = wire.tensor_frames(tensor, name, wire.SendOptions(chunk_bytes, checksum=checksum))
    return [CHUNK_CODEC.deserialize(CHUNK_CODEC.serialize(frame)) for frame in sent]


def round_trip(tensor: torch.Tensor, chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES, name: str = "t") -> torch.Tensor:
    received = list(wire.read_tensors(tensor_frames(tensor, name, chunk_bytes)))
    assert [n for n, _ in received] == [name]
    return received[0][1]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality, NaN and -0.0 included: dtype, shape and bytes."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def header_chunk(dtype=tensor_pb2.DTYPE_FLOAT32, shape=(2,), nbytes=8, data=b"", name="t") -> Frame:
    header = tensor_pb2.TensorHeader(name=name, dtype=dtype, shape=shape, nbytes=nbytes, wire_nbytes=nbytes)
    return Frame(tensor_pb2.TensorChunk(header=header, crc32=zlib.crc32(data)), data)


def data_chunk(data: bytes, offset: int = 0) -> Frame:
    return Frame(tensor_pb2.TensorChunk(offset=offset, crc32=zlib.crc32(data)), data)


@pytest.mark.parametrize(("dtype", "code"), WIRE_CODES)
def test_dtype_table_maps_both_ways(dtype, code):
    assert wire.dtype_code(dtype) == code
    assert wire.torch_dtype(code) == dtype


def test_dtype_outside_the_table_cannot_be_sent():
    with pytest.raises(InvalidArgument, match="complex64"):
        tensor_frames(torch.zeros(2, dtype=torch.complex64))


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
    chunks = (tensor_frames(torch.zeros(0, 3), "empty"))
    assert len(chunks) == 1
    assert chunks[0].chunk.header.nbytes == 0 and list(chunks[0].chunk.header.shape) == [0, 3]
    assert bytes(chunks[0].data) == b""
    assert round_trip(torch.zeros(0, 3)).shape == (0, 3)


def test_zero_dim_scalar_keeps_its_empty_shape():
    received = round_trip(torch.tensor(3.5, dtype=torch.float64))
    assert received.shape == ()
    assert received.item() == 3.5


def test_header_describes_the_tensor():
    chunks = (tensor_frames(torch.zeros(2, 3, dtype=torch.int16), "activation"))
    header = chunks[0].chunk.header
    assert (header.name, header.dtype, list(header.shape), header.nbytes, header.wire_nbytes) == (
        "activation", tensor_pb2.DTYPE_INT16, [2, 3], 12, 12)


def test_chunk_smaller_than_tensor_splits_data_and_only_first_has_header():
    chunks = (tensor_frames(torch.arange(10, dtype=torch.float32), "t", chunk_bytes=16))
    assert [len(c.data) for c in chunks] == [16, 16, 8]
    assert [c.chunk.offset for c in chunks] == [0, 16, 32]
    assert [c.chunk.HasField("header") for c in chunks] == [True, False, False]


def test_exact_multiple_of_chunk_size_has_no_trailing_empty_chunk():
    original = torch.arange(10, dtype=torch.float32)
    chunks = (tensor_frames(original, "t", chunk_bytes=8))
    assert [len(c.data) for c in chunks] == [8] * 5
    assert torch.equal(round_trip(original, chunk_bytes=8), original)


def test_gradient_tracking_tensor_is_sent_detached():
    original = torch.randn(3, requires_grad=True)
    received = round_trip(original * 2)
    assert not received.requires_grad
    assert torch.equal(received, (original * 2).detach())


def test_read_tensors_yields_each_tensor_of_a_stream_in_order():
    a, b = torch.arange(6, dtype=torch.int64), torch.ones(2, 2, dtype=torch.bool)
    chunks = [*tensor_frames(a, "a", chunk_bytes=16), *tensor_frames(b, "b", chunk_bytes=16)]
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
    codec = Codec(shard_pb2.LoadStateRequest)
    sent = wire.framed(shard_pb2.LoadStateRequest, header, tensors, wire.SendOptions(chunk_bytes=8))
    frames = [codec.deserialize(codec.serialize(frame)) for frame in sent]
    messages = [frame.message for frame in frames]
    assert [m.HasField("header") for m in messages] == [True, False, False]
    assert messages[0].header.deployment_id == "d1"
    assert all(m.HasField("tensor") for m in messages)
    received = dict(wire.read_tensors(frames))
    assert set(received) == {"0.weight", "0.bias"}
    assert torch.equal(received["0.bias"], torch.ones(2))


def test_framed_without_tensors_yields_one_header_only_message():
    header = shard_pb2.LoadStateHeader(deployment_id="d1")
    messages = [frame.message for frame in wire.framed(shard_pb2.LoadStateRequest, header, {})]
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
        reader.feed(data_chunk(b"\0" * 8, offset=4))


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
    chunks = (tensor_frames(torch.zeros(10), "t", chunk_bytes=16))
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


@pytest.mark.skipif(pathlib.Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1",
                    reason="with overcommit always on, a 1 TiB allocation succeeds until it is touched")
def test_a_tensor_within_the_limit_but_beyond_the_hosts_memory_is_resource_exhausted():
    shape = (1 << 38,)  # 1 TiB of float32, the limit itself: more than this host can allocate
    with pytest.raises(ResourceExhausted, match=f"no memory for its {4 << 38} bytes"):
        wire.TensorStreamReader().feed(header_chunk(shape=shape, nbytes=4 << 38, data=b"\0" * 16))


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
    chunks = [*tensor_frames(a, "a", chunk_bytes=10), *tensor_frames(b, "b", chunk_bytes=10)]
    tensors = asyncio.run(wire.collect(as_stream(chunks)))
    assert set(tensors) == {"a", "b"}
    assert torch.equal(tensors["a"], a) and torch.equal(tensors["b"], b)


def test_collect_of_empty_stream_is_empty():
    assert asyncio.run(wire.collect(as_stream([]))) == {}


def test_collect_reports_a_truncated_stream():
    chunks = (tensor_frames(torch.zeros(4), "t", chunk_bytes=8))
    with pytest.raises(DataLoss, match="'t'"):
        asyncio.run(wire.collect(as_stream(chunks[:1])))


# Integrity: every chunk carries its offset, and its checksum (CRC-32C or CRC-32) when the sender adds one.

@pytest.mark.parametrize("kind", ["crc32", "crc32c"])
def test_a_corrupted_chunk_is_data_loss_not_a_wrong_tensor(kind):
    frames = tensor_frames(torch.arange(64, dtype=torch.float32), "t", chunk_bytes=64, checksum=kind)
    other = "crc32" if kind == "crc32c" else "crc32c"
    assert all(frame.chunk.HasField(kind) and not frame.chunk.HasField(other) for frame in frames)
    assert torch.equal(next(wire.read_tensors(frames))[1], torch.arange(64, dtype=torch.float32))
    corrupted = bytearray(frames[1].data)
    corrupted[5] ^= 0x01
    frames[1] = Frame(frames[1].message, bytes(corrupted))
    with pytest.raises(DataLoss, match=rf"'t'.*offset 64.*{checksums.NAMES[kind]} check"):
        list(wire.read_tensors(frames))


@pytest.mark.parametrize("kind", ["crc32", "crc32c"])
def test_chunks_carry_no_checksum_unless_asked_and_a_zero_checksum_is_still_checked(kind):
    frames = tensor_frames(torch.arange(64, dtype=torch.float32), "t", chunk_bytes=64)
    assert not any(frame.chunk.HasField("crc32") or frame.chunk.HasField("crc32c") for frame in frames)
    assert torch.equal(next(wire.read_tensors(frames))[1], torch.arange(64, dtype=torch.float32))
    setattr(frames[1].chunk, kind, 0)  # present, and wrong: a sender that asks for checking gets it
    with pytest.raises(DataLoss, match=rf"'t'.*offset 64.*{checksums.NAMES[kind]} check"):
        list(wire.read_tensors(frames))


def test_without_the_crc32c_package_crc32_still_works_and_a_crc32c_chunk_is_refused_by_name(monkeypatch):
    crc32c_frames = tensor_frames(torch.arange(64, dtype=torch.float32), "t", chunk_bytes=64, checksum="crc32c")
    monkeypatch.setattr(checksums, "_crc32c", None)
    with pytest.raises(ValueError, match="crc32c package"):
        checksums.kind("crc32c")
    crc32_frames = tensor_frames(torch.arange(64, dtype=torch.float32), "t", chunk_bytes=64, checksum="crc32")
    assert torch.equal(next(wire.read_tensors(crc32_frames))[1], torch.arange(64, dtype=torch.float32))
    with pytest.raises(FailedPrecondition, match=r"'t'.*carries a CRC-32C.*pip install crc32c"):
        list(wire.read_tensors(crc32c_frames))


def test_a_chunk_out_of_order_is_data_loss():
    frames = tensor_frames(torch.arange(64, dtype=torch.float32), "t", chunk_bytes=64)
    with pytest.raises(DataLoss, match="chunk at offset 128, expected 64"):
        list(wire.read_tensors([frames[0], frames[2]]))


def test_a_resumed_stream_continues_the_tensor_from_the_offset_reached():
    original = torch.randn(100)
    reader = wire.TensorStreamReader()
    for frame in tensor_frames(original, "t", chunk_bytes=64)[:3]:  # the stream breaks after 192 bytes
        assert reader.feed(frame) is None
    assert reader.resume_offset == 192
    resumed = wire.tensor_frames(original, "t", wire.SendOptions(chunk_bytes=64), start=reader.resume_offset)
    results = [reader.feed(CHUNK_CODEC.deserialize(CHUNK_CODEC.serialize(frame))) for frame in resumed]
    assert results[-1][0] == "t" and torch.equal(results[-1][1], original)


def test_a_resumed_stream_for_another_tensor_is_data_loss():
    reader = wire.TensorStreamReader()
    reader.feed(tensor_frames(torch.zeros(100), "t", chunk_bytes=64)[0])
    other = wire.tensor_frames(torch.zeros(50), "t", wire.SendOptions(chunk_bytes=64), start=64)
    with pytest.raises(DataLoss, match="new header"):
        reader.feed(next(other))


# Wire encodings: lossy for floating point, exact for everything else.

@pytest.mark.parametrize(("name", "ratio", "tolerance"), [("fp16", 0.5, 1e-3), ("bf16", 0.5, 8e-3),
                                                         ("int8", 0.26, 2e-2)])
def test_lossy_encodings_shrink_floats_within_their_error(name, ratio, tolerance):
    original = torch.randn(64, 64)
    options = wire.SendOptions(encoding=wire.encoding_code(name))
    frames = [CHUNK_CODEC.deserialize(CHUNK_CODEC.serialize(f)) for f in wire.tensor_frames(original, "t", options)]
    header = frames[0].chunk.header
    assert header.wire_nbytes <= ratio * header.nbytes + 1
    _, received = next(wire.read_tensors(frames))
    assert received.dtype == torch.float32 and received.shape == original.shape
    assert (received - original).abs().max() <= tolerance * original.abs().max()


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8])
def test_lossy_encoding_leaves_non_float_tensors_exact(dtype):
    original = sample(dtype)
    options = wire.SendOptions(encoding=wire.encoding_code("int8"))
    frames = list(wire.tensor_frames(original, "t", options))
    assert frames[0].chunk.header.encoding == tensor_pb2.ENCODING_NONE
    assert same_bits(next(wire.read_tensors(frames))[1], original)


def test_header_whose_wire_size_disagrees_with_its_encoding_is_invalid_argument():
    frame = header_chunk(shape=(256,), nbytes=1024)
    frame.message.header.encoding = tensor_pb2.ENCODING_FLOAT16
    with pytest.raises(InvalidArgument, match="needs 512"):
        wire.TensorStreamReader().feed(frame)


def test_compression_spec_by_kind_and_bad_specs():
    encodings = wire.wire_encodings({"gradients": "bf16"})
    assert (encodings.activations, encodings.gradients) == (tensor_pb2.ENCODING_NONE, tensor_pb2.ENCODING_BFLOAT16)
    assert wire.wire_encodings("int8").residuals == tensor_pb2.ENCODING_INT8_BLOCKWISE
    with pytest.raises(InvalidArgument, match="unknown wire encoding 'fp8'"):
        wire.wire_encodings("fp8")
    with pytest.raises(InvalidArgument, match=r"unknown tensor kinds \['weights'\]"):
        wire.wire_encodings({"weights": "fp16"})


# The same-host path: one frame, the tensor's storage mapped from the sender's segment.

@pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_segment_round_trip_is_exact(dtype):
    original = sample(dtype, shape=(300, 300))  # at least shm.MIN_BYTES for every dtype
    pool = shm.SegmentPool()
    try:
        frames = list(wire.tensor_frames(original, "t", wire.SendOptions(segments=pool)))
        assert len(frames) == 1 and frames[0].chunk.HasField("shared") and len(frames[0].data) == 0
        assert same_bits(next(wire.read_tensors(frames))[1], original)
    finally:
        pool.close()


@pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")
def test_small_tensors_ride_in_the_message_even_with_segments():
    pool = shm.SegmentPool()
    try:
        frames = list(wire.tensor_frames(torch.ones(8), "t", wire.SendOptions(segments=pool)))
        assert not frames[0].chunk.HasField("shared") and len(frames[0].data) == 32
    finally:
        pool.close()


def test_tensor_over_2_gib_round_trips():
    original = torch.empty((1 << 31) + 8, dtype=torch.uint8)
    original[:4096] = torch.arange(4096) % 251
    original[-4096:] = torch.arange(4096) % 241
    options = wire.SendOptions(chunk_bytes=64 << 20)
    reader, received = wire.TensorStreamReader(), None
    for frame in wire.tensor_frames(original, "big", options):  # frames go one at a time, as on the wire
        received = reader.feed(frame) or received
    assert received[1].numel() == original.numel()
    assert torch.equal(received[1][:4096], original[:4096]) and torch.equal(received[1][-4096:], original[-4096:])


def test_collect_with_a_count_returns_before_the_stream_ends():
    frames = tensor_frames(torch.ones(3), "first") + tensor_frames(torch.zeros(2), "second")

    async def never_ending():
        for frame in frames:
            yield frame
        await asyncio.Event().wait()  # the sender has not closed its side
    tensors = asyncio.run(asyncio.wait_for(wire.collect(never_ending(), count=1), timeout=5))
    assert list(tensors) == ["first"]
