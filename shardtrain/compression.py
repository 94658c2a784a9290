"""Lossy wire encodings of floating-point tensors (fp16, bf16, blockwise int8) for compressed transfers."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from shardtrain.errors import InvalidArgument

ENCODINGS = ("none", "fp16", "bf16", "int8")
# Elements per int8 block. Relative RMS error of a round trip (2**22 elements) against payload size:
#   block   bytes/fp32   normal   student-t(3)   outlier columns (1% x30)
#     64      0.266      0.0059      0.0109          0.0163
#    256      0.254      0.0070      0.0175          0.0286
#   1024      0.251      0.0079      0.0278          0.0424
# Speed is the same from 64 to 4096. No size is clearly better: 64 costs 4.6% more bytes for 15-43% less error,
# 1024 saves 1.1% for 13-59% more, so 256 stays.
BLOCK_SIZE = 256

_FLOAT_WIDE = frozenset({torch.float32, torch.float64})
# Which source dtypes each encoding changes; everything else (and "none") travels exact.
_APPLIES: dict[str, frozenset[torch.dtype]] = {
    "none": frozenset(),
    "fp16": _FLOAT_WIDE,
    "bf16": _FLOAT_WIDE,
    "int8": _FLOAT_WIDE | {torch.float16, torch.bfloat16},
}
_HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_SCALE_BYTES = 4  # one float32 scale per int8 block
# Blocks per quantisation step (1 MiB of float32 scratch). int8 encode of 64 MiB, median ms, by _CHUNK_BLOCKS:
# 64: 44, 256: 17, 1024: 12, 4096: 14, 16384: 16, 65536 (one chunk, a fresh 64 MiB temporary): 43.
_CHUNK_BLOCKS = 1024
_QMAX = 127  # symmetric range: -128 is never used, so q and -q are both representable


def _check_encoding(encoding: str) -> None:
    """Raises InvalidArgument naming `encoding` and the valid names when it is not one of ENCODINGS."""
    if encoding not in _APPLIES:
        raise InvalidArgument(f"unknown wire encoding {encoding!r}; expected one of {ENCODINGS}")


def applies(encoding: str, dtype: torch.dtype) -> bool:
    """Whether `encoding` changes a tensor of `dtype`; InvalidArgument for unknown encodings."""
    _check_encoding(encoding)
    return dtype in _APPLIES[encoding]


def _check_applies(encoding: str, dtype: torch.dtype) -> None:
    """Raises InvalidArgument when `encoding` does not apply to `dtype` (so encode/decode would be wrong)."""
    if not applies(encoding, dtype):
        accepted = sorted(str(d) for d in _APPLIES[encoding]) or "no dtype"
        raise InvalidArgument(f"wire encoding {encoding!r} does not apply to {dtype} tensors; "
                              f"it applies to {accepted}")


def _num_blocks(numel: int) -> int:
    """Number of int8 blocks (the last may be short) for `numel` elements."""
    return -(-numel // BLOCK_SIZE)


def encoded_nbytes(encoding: str, dtype: torch.dtype, numel: int) -> int:
    """Bytes of the encoded payload for `numel` elements of `dtype` (numel * itemsize when not applies())."""
    if numel < 0:
        raise InvalidArgument(f"element count must be >= 0, got {numel}")
    if not applies(encoding, dtype):
        return numel * dtype.itemsize
    if encoding == "int8":
        return _num_blocks(numel) * _SCALE_BYTES + numel
    return numel * _HALF_DTYPES[encoding].itemsize


def _per_block(op: Callable[..., torch.Tensor], values: torch.Tensor, per_block: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:
    """out = op(values, factor of its block) for 1-D `values` whose first element starts a block."""
    full_blocks = values.numel() // BLOCK_SIZE
    full = full_blocks * BLOCK_SIZE
    op(values[:full].view(full_blocks, BLOCK_SIZE), per_block[:full_blocks, None],
       out=out[:full].view(full_blocks, BLOCK_SIZE))
    op(values[full:], per_block[full_blocks:], out=out[full:])  # the short last block, if any
    return out


def _absmax_rows(rows: torch.Tensor) -> torch.Tensor:
    """max |x| of each row; NaN propagates. amax and amin are vectorised where vector_norm(ord=inf) and
    aminmax are not (an order of magnitude faster on a large float32 tensor)."""
    return torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())


def _block_absmax(values: torch.Tensor) -> torch.Tensor:
    """max |x| of each block of 1-D `values`, the short last block included."""
    full = values.numel() // BLOCK_SIZE * BLOCK_SIZE
    absmax = _absmax_rows(values[:full].view(-1, BLOCK_SIZE))
    if full == values.numel():
        return absmax
    return torch.cat([absmax, _absmax_rows(values[full:].view(1, -1))])


def _quantise(values: torch.Tensor, divisors: torch.Tensor, out: torch.Tensor) -> None:
    """out = clamp(round(values / divisor of the block)) as int8; NaN (from inf/inf or NaN inputs) becomes 0."""
    # A loop over chunks of _CHUNK_BLOCKS blocks, not over blocks: they share one small cache-resident scratch
    # buffer, where one tensor-sized float32 temporary costs ~20 ms of page faults per 64 MiB (see _CHUNK_BLOCKS).
    step = _CHUNK_BLOCKS * BLOCK_SIZE
    scratch = torch.empty(min(step, values.numel()), dtype=torch.float32, device=values.device)
    for start in range(0, values.numel(), step):
        chunk = values[start:start + step]
        work = _per_block(torch.div, chunk, divisors[start // BLOCK_SIZE:][:_CHUNK_BLOCKS],
                          scratch[:chunk.numel()])
        # clamp guards scales too small (subnormal) to divide back to <= 127; NaN would cast to an arbitrary int8.
        out[start:start + step].copy_(work.round_().clamp_(-_QMAX, _QMAX).nan_to_num_(0.0))


def _encode_int8(tensor: torch.Tensor) -> torch.Tensor:
    """Blockwise absmax int8: float32 scales of all blocks, then the int8 values."""
    values = tensor.to(torch.float32).reshape(-1).contiguous()  # copies only when dtype or strides demand it
    scale_bytes = _num_blocks(values.numel()) * _SCALE_BYTES
    payload = torch.empty(scale_bytes + values.numel(), dtype=torch.uint8, device=values.device)
    scales = torch.div(_block_absmax(values), _QMAX, out=payload[:scale_bytes].view(torch.float32))
    divisors = torch.where(scales == 0, 1.0, scales)  # all-zero blocks: 0 / 1 = 0, no NaN, exact zeros back
    _quantise(values, divisors, payload[scale_bytes:].view(torch.int8))
    return payload.cpu()


def encode(tensor: torch.Tensor, encoding: str) -> torch.Tensor:
    """A 1-D contiguous uint8 CPU tensor of the encoded bytes; only valid when applies(encoding, dtype).

    fp16: values beyond float16's range (|x| > 65504) become +-inf, and tiny ones flush towards 0, exactly as
    `tensor.half()` does. bf16 keeps float32's range (8 bits of mantissa). float64 values beyond float32's
    range become +-inf under bf16 and int8, which compute in float32.
    int8: each block of BLOCK_SIZE elements keeps scale = absmax / 127 and round(x / scale) in [-127, 127],
    so |error| <= scale / 2 for normal-range scales. A block containing inf or NaN decodes to all NaN (its
    scale is inf or NaN); other blocks are unaffected.
    """
    _check_applies(encoding, tensor.dtype)
    tensor = tensor.detach()
    if encoding == "int8":
        return _encode_int8(tensor)
    half = tensor.to(_HALF_DTYPES[encoding]).cpu().contiguous()
    return half.reshape(-1).view(torch.uint8)


def _aligned(payload: torch.Tensor, itemsize: int) -> torch.Tensor:
    """`payload`, copied when its offset forbids viewing it as `itemsize`-byte elements (a slice of a buffer)."""
    return payload if payload.storage_offset() % itemsize == 0 else payload.clone()


def _decode_int8(payload: torch.Tensor, numel: int) -> torch.Tensor:
    """float32 values of an int8 payload: q * scale per block."""
    scale_bytes = _num_blocks(numel) * _SCALE_BYTES
    scales = _aligned(payload[:scale_bytes], _SCALE_BYTES).view(torch.float32)
    values = payload[scale_bytes:].view(torch.int8).to(torch.float32)
    # In place on the float copy: mul(int8, float32, out=float32) takes a slow mixed-dtype path (2x slower).
    return _per_block(torch.mul, values, scales, values)


def _check_payload(payload: torch.Tensor, encoding: str, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """The element count of `shape`; InvalidArgument unless `payload` is 1-D uint8 of the expected length."""
    _check_applies(encoding, dtype)
    if any(dim < 0 for dim in shape):
        raise InvalidArgument(f"negative dimension in shape {tuple(shape)}")
    expected = encoded_nbytes(encoding, dtype, math.prod(shape))
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
        raise InvalidArgument(f"{encoding!r} payload for a {dtype} tensor of shape {tuple(shape)} must be "
                              f"1-D uint8 of {expected} bytes; got {payload.dtype} of shape "
                              f"{tuple(payload.shape)}")
    return math.prod(shape)


def decode(payload: torch.Tensor, encoding: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of `dtype` and `shape` that `payload` (1-D uint8, encoded_nbytes(...) long) encodes."""
    numel = _check_payload(payload, encoding, dtype, shape)
    payload = payload.contiguous()
    if encoding == "int8":
        return _decode_int8(payload, numel).view(shape).to(dtype)
    half_dtype = _HALF_DTYPES[encoding]
    return _aligned(payload, half_dtype.itemsize).view(half_dtype).view(shape).to(dtype)
