"""shardtrain.compression: round trips, stated error bounds, payload layout and sizes, and bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

from shardtrain import compression
from shardtrain.compression import (
    BLOCK_SIZE,
    ENCODINGS,
    applies,
    decode,
    encode,
    encoded_nbytes,
)
from shardtrain.errors import InvalidArgument

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OTHER_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
# Every pair where an encoding changes the tensor; all other pairs travel exact.
LOSSY = [("fp16", torch.float32), ("fp16", torch.float64), ("bf16", torch.float32), ("bf16", torch.float64),
         ("int8", torch.float32), ("int8", torch.float64), ("int8", torch.float16), ("int8", torch.bfloat16)]
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (BLOCK_SIZE,), (BLOCK_SIZE + 1,), (3, 257), (2, 300, 5)]
# Unit roundoff of each dtype: the relative error of one rounding to it.
ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def normal(shape, generator: torch.Generator, decades: float = 0) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def heavy_tailed(shape, generator: torch.Generator, decades: float = 0) -> torch.Tensor:
    """A log-normal scale mixture of normals: most values near 1, a few 1e3 to 1e4 times larger."""
    return normal(shape, generator) * torch.exp(2 * normal(shape, generator))


def mixed_per_block(shape, generator: torch.Generator, decades: float = 6) -> torch.Tensor:
    """Runs of 64 elements (several per int8 block) whose magnitudes span 10**-decades to 10**decades."""
    numel = math.prod(shape)
    magnitudes = 10.0 ** torch.empty(-(-numel // 64), 1, dtype=torch.float64).uniform_(-decades, decades,
                                                                                        generator=generator)
    return (normal(numel, generator) * magnitudes.expand(-1, 64).reshape(-1)[:numel]).reshape(shape)


DISTRIBUTIONS = [normal, heavy_tailed, mixed_per_block]


def sample(distribution, shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Seeded values of `distribution`, kept inside float16's range (max 65504) for float16."""
    decades = 2 if dtype == torch.float16 else 6
    return distribution(shape, torch.Generator().manual_seed(seed), decades).to(dtype)


def round_trip(tensor: torch.Tensor, encoding: str) -> torch.Tensor:
    return decode(encode(tensor, encoding), encoding, tensor.dtype, tuple(tensor.shape))


def block_absmax(tensor: torch.Tensor) -> torch.Tensor:
    """Reference per-element absmax of its int8 block, in float64, shaped like the flattened tensor."""
    flat = tensor.detach().reshape(-1).double().abs()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK_SIZE)).view(-1, BLOCK_SIZE)
    return padded.amax(dim=1, keepdim=True).expand(-1, BLOCK_SIZE).reshape(-1)[:flat.numel()]


def test_applies_table():
    for encoding in ENCODINGS:
        for dtype in FLOATS + OTHER_DTYPES:
            assert applies(encoding, dtype) == ((encoding, dtype) in LOSSY), (encoding, dtype)


@pytest.mark.parametrize("encoding,dtype", LOSSY)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_keeps_dtype_shape_and_size(encoding, dtype, shape):
    tensor = sample(normal, shape, dtype)
    payload = encode(tensor, encoding)
    assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.is_contiguous()
    assert payload.device.type == "cpu"
    assert payload.numel() == encoded_nbytes(encoding, dtype, tensor.numel())
    result = decode(payload, encoding, dtype, shape)
    assert result.dtype == dtype and tuple(result.shape) == shape
    assert torch.isfinite(result).all()


@pytest.mark.parametrize("encoding,dtype", LOSSY)
def test_non_contiguous_input_encodes_like_its_contiguous_copy(encoding, dtype):
    base = sample(normal, (40, 30), dtype)
    for view in (base.t(), base[::3, 1::2], base.view(-1)[::2], base.t()[5]):
        assert not view.is_contiguous()
        assert torch.equal(encode(view, encoding), encode(view.contiguous(), encoding))
        assert tuple(round_trip(view, encoding).shape) == tuple(view.shape)


@pytest.mark.parametrize("encoding,dtype", LOSSY)
def test_encode_leaves_its_input_alone(encoding, dtype):
    tensor = sample(heavy_tailed, (3, 300), dtype)
    before = tensor.clone()
    encode(tensor, encoding)
    assert torch.equal(tensor, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(3))
def test_fp16_relative_error_within_half_an_ulp(dtype, seed):
    """fp16 keeps 11 significant bits: |x - x'| <= 2**-11 |x| for |x| in float16's normal range [2**-14, 65504]."""
    generator = torch.Generator().manual_seed(seed)
    exponents = torch.empty(5000, dtype=torch.float64).uniform_(-14, 15.99, generator=generator)
    tensor = (torch.sign(normal(5000, generator)) * 2.0**exponents).to(dtype)
    error = (tensor.double() - round_trip(tensor, "fp16").double()).abs()
    assert (error <= 2.0**-11 * tensor.double().abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(3))
def test_bf16_relative_error_within_half_an_ulp(dtype, seed):
    """bf16 keeps 8 significant bits over float32's exponent range: |x - x'| <= 2**-8 |x|."""
    generator = torch.Generator().manual_seed(seed)
    exponents = torch.empty(5000, dtype=torch.float64).uniform_(-120, 120, generator=generator)
    tensor = (torch.sign(normal(5000, generator)) * 2.0**exponents).to(dtype)
    error = (tensor.double() - round_trip(tensor, "bf16").double()).abs()
    assert (error <= 2.0**-8 * tensor.double().abs()).all()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("shape", [(5000,), (7, 3, 129), (1,)])
def test_int8_error_within_half_a_step_of_its_block(dtype, distribution, shape):
    """|x - x'| <= scale / 2 = absmax(block) / 254, plus float32 rounding slack and the final cast to dtype
    (half an ulp of the result, or of the smallest normal for subnormal results)."""
    for seed in range(3):
        tensor = sample(distribution, shape, dtype, seed)
        result = round_trip(tensor, "int8")
        exact, decoded = tensor.reshape(-1).double(), result.reshape(-1).double()
        bound = block_absmax(tensor) / 254 * (1 + 1e-4) + (decoded.abs() + torch.finfo(dtype).tiny) * ROUNDOFF[dtype]
        assert ((exact - decoded).abs() <= bound).all()


def test_int8_payload_layout_is_scales_then_values():
    tensor = sample(heavy_tailed, (3 * BLOCK_SIZE + 10,), torch.float32)
    payload = encode(tensor, "int8")
    nblocks = 4
    scales = payload[:nblocks * 4].view(torch.float32)
    values = payload[nblocks * 4:].view(torch.int8)
    assert payload.numel() == nblocks * 4 + tensor.numel()
    assert torch.equal(scales, block_absmax(tensor)[::BLOCK_SIZE].float() / 127)
    assert values.abs().max() == 127  # each block's largest |x| maps to exactly +-127
    assert torch.equal(values.float(), torch.round(tensor / scales.repeat_interleave(BLOCK_SIZE)[:tensor.numel()]))


@pytest.mark.parametrize("encoding,dtype", [("fp16", torch.float32), ("bf16", torch.float32),
                                            ("fp16", torch.float64), ("bf16", torch.float64)])
def test_half_payload_is_the_cast_tensors_bytes(encoding, dtype):
    tensor = sample(normal, (4, 5), dtype)
    half = tensor.to(torch.float16 if encoding == "fp16" else torch.bfloat16)
    assert torch.equal(encode(tensor, encoding), half.reshape(-1).view(torch.uint8))


def test_fp16_overflows_to_inf_like_half_and_bf16_keeps_the_range():
    tensor = torch.tensor([1e5, -1e5, 65504.0, 1e30, -1e-30])
    assert torch.equal(round_trip(tensor, "fp16"), tensor.half().float())
    assert round_trip(tensor, "fp16")[:2].tolist() == [math.inf, -math.inf]
    assert torch.isfinite(round_trip(tensor, "bf16")).all()


@pytest.mark.parametrize("dtype", FLOATS)
def test_int8_all_zero_block_decodes_to_exact_zeros(dtype):
    tensor = sample(normal, (3 * BLOCK_SIZE,), dtype)
    tensor[BLOCK_SIZE:2 * BLOCK_SIZE] = 0
    tensor[BLOCK_SIZE + 3] = -0.0
    result = round_trip(tensor, "int8")
    assert torch.equal(result[BLOCK_SIZE:2 * BLOCK_SIZE], torch.zeros(BLOCK_SIZE, dtype=dtype))
    assert torch.isfinite(result).all()
    assert torch.equal(round_trip(torch.zeros(5, 7, dtype=dtype), "int8"), torch.zeros(5, 7, dtype=dtype))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_int8_non_finite_value_makes_only_its_block_nan(bad):
    tensor = sample(normal, (2 * BLOCK_SIZE + 5,), torch.float32)
    tensor[BLOCK_SIZE + 7] = bad
    payload = encode(tensor, "int8")
    result = decode(payload, "int8", torch.float32, tuple(tensor.shape))
    assert result[BLOCK_SIZE:2 * BLOCK_SIZE].isnan().all()
    assert torch.isfinite(result[:BLOCK_SIZE]).all() and torch.isfinite(result[2 * BLOCK_SIZE:]).all()
    # The block's int8 values are all 0 (not whatever NaN happens to cast to), so payloads are reproducible.
    assert (payload[3 * 4 + BLOCK_SIZE:3 * 4 + 2 * BLOCK_SIZE] == 0).all()


def test_int8_keeps_tiny_blocks_next_to_huge_ones():
    tensor = torch.cat([torch.full((BLOCK_SIZE,), 1e30), torch.linspace(-1e-30, 1e-30, BLOCK_SIZE)])
    result = round_trip(tensor, "int8")
    assert ((result[BLOCK_SIZE:] - tensor[BLOCK_SIZE:]).abs() <= 1e-30 / 254 * (1 + 1e-4)).all()


@pytest.mark.parametrize("numel", [0, 1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 100_000])
def test_encoded_nbytes(numel):
    fp32_bytes = 4 * numel
    assert encoded_nbytes("fp16", torch.float32, numel) == encoded_nbytes("bf16", torch.float32, numel) == 2 * numel
    assert encoded_nbytes("fp16", torch.float64, numel) == 2 * numel
    assert encoded_nbytes("int8", torch.float32, numel) == numel + 4 * -(-numel // BLOCK_SIZE)
    assert encoded_nbytes("int8", torch.bfloat16, numel) == numel + 4 * -(-numel // BLOCK_SIZE)
    if numel >= 100_000:
        assert encoded_nbytes("int8", torch.float32, numel) / fp32_bytes < 0.25 + 1.01 / BLOCK_SIZE
    for encoding in ENCODINGS:
        assert encoded_nbytes(encoding, torch.int64, numel) == 8 * numel
    assert encoded_nbytes("none", torch.float32, numel) == fp32_bytes


def test_decode_accepts_a_payload_at_an_odd_offset():
    tensor = sample(normal, (3, 100), torch.float32)
    for encoding in ("fp16", "bf16", "int8"):
        payload = encode(tensor, encoding)
        buffer = torch.cat([torch.zeros(1, dtype=torch.uint8), payload])
        assert torch.equal(decode(buffer[1:], encoding, torch.float32, (3, 100)), round_trip(tensor, encoding))


@pytest.mark.parametrize("call", [
    lambda: applies("int4", torch.float32),
    lambda: encoded_nbytes("int4", torch.float32, 3),
    lambda: encode(torch.ones(3), "int4"),
    lambda: decode(torch.zeros(3, dtype=torch.uint8), "int4", torch.float32, (3,)),
])
def test_unknown_encoding_names_it_and_the_valid_ones(call):
    with pytest.raises(InvalidArgument) as raised:
        call()
    assert "'int4'" in str(raised.value)
    assert all(name in str(raised.value) for name in ENCODINGS)


@pytest.mark.parametrize("encoding", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_payload_length_says_what_was_expected(encoding, delta):
    payload = encode(torch.ones(2, 300), encoding)
    wrong = torch.zeros(payload.numel() + delta, dtype=torch.uint8)
    with pytest.raises(InvalidArgument, match=f"{payload.numel()} bytes") as raised:
        decode(wrong, encoding, torch.float32, (2, 300))
    assert f"({payload.numel() + delta},)" in str(raised.value) and "(2, 300)" in str(raised.value)


def test_payload_must_be_flat_uint8():
    payload = encode(torch.ones(4), "fp16")
    with pytest.raises(InvalidArgument, match="1-D uint8"):
        decode(payload.view(torch.int8), "fp16", torch.float32, (4,))
    with pytest.raises(InvalidArgument, match="1-D uint8"):
        decode(payload.view(2, 4), "fp16", torch.float32, (4,))
    with pytest.raises(InvalidArgument, match="negative"):
        decode(payload, "fp16", torch.float32, (-2, -2))


@pytest.mark.parametrize("encoding,dtype", [("none", torch.float32), ("fp16", torch.float16),
                                            ("bf16", torch.bfloat16), ("int8", torch.int64),
                                            ("fp16", torch.bool)])
def test_encode_and_decode_refuse_pairs_that_do_not_apply(encoding, dtype):
    with pytest.raises(InvalidArgument, match=f"{encoding!r} does not apply to {dtype}"):
        encode(torch.zeros(3, dtype=dtype), encoding)
    with pytest.raises(InvalidArgument, match="does not apply"):
        decode(torch.zeros(6, dtype=torch.uint8), encoding, dtype, (3,))


def test_negative_element_count_is_refused():
    with pytest.raises(InvalidArgument, match="-1"):
        encoded_nbytes("int8", torch.float32, -1)


def test_chunked_quantisation_matches_across_chunk_boundaries(monkeypatch):
    """Encoding in chunks of 2 blocks gives the same bytes as in one chunk, the short last block included."""
    tensor = sample(heavy_tailed, (7 * BLOCK_SIZE + 3,), torch.float32)
    expected = encode(tensor, "int8")
    monkeypatch.setattr(compression, "_CHUNK_BLOCKS", 2)
    assert torch.equal(encode(tensor, "int8"), expected)


@pytest.mark.parametrize("encoding,dtype", LOSSY)
def test_decoded_tensor_owns_its_memory(encoding, dtype):
    """Receivers may reuse the payload buffer (a shared-memory segment) once decode returns."""
    payload = encode(sample(normal, (2, 300), dtype), encoding)
    result = decode(payload, encoding, dtype, (2, 300))
    before = result.clone()
    payload.fill_(0x7F)
    assert torch.equal(result, before)
