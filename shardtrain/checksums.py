"""Checksums of tensor chunks: CRC-32C (the crc32c package, in hardware where the CPU has it) or CRC-32 (zlib).

A sender adds one kind to each chunk (--checksums, SHARDTRAIN_CHECKSUMS); a receiver checks whichever a chunk
carries, so peers of either setting work together. Without the crc32c package a process sends CRC-32 and
refuses, naming the package, a chunk that only CRC-32C could check.
"""

from __future__ import annotations

import zlib

from shardtrain.errors import DataLoss, FailedPrecondition

try:
    import crc32c as _crc32c
except ImportError:  # a platform the package does not build on: CRC-32 only
    _crc32c = None

KINDS = ("off", "crc32", "crc32c")
STRONGEST = "crc32c" if _crc32c is not None else "crc32"  # what "on" means here, and what snapshots always use
DEFAULT = "off"
NAMES = {"crc32": "CRC-32", "crc32c": "CRC-32C"}


def kind(text: str) -> str:
    """The kind a flag's value names ("on" is the strongest here); ValueError for others and for "crc32c" where
    the crc32c package is missing."""
    chosen = STRONGEST if text == "on" else text
    if chosen not in KINDS:
        raise ValueError(f"checksums {text!r}: one of on, {', '.join(KINDS)}")
    if chosen == "crc32c" and _crc32c is None:
        raise ValueError("checksums crc32c need the crc32c package (pip install crc32c); crc32 works without it")
    return chosen


def _value(kind: str, data) -> int:
    return _crc32c.crc32c(data) if kind == "crc32c" else zlib.crc32(data)


def stamp(chunk, data, kind: str) -> None:
    """Sets `chunk`'s checksum field of `kind` to that of `data` (nothing for "off")."""
    if kind != "off":
        setattr(chunk, kind, _value(kind, data))


def verify(chunk, data, name: str) -> None:
    """Checks every checksum a chunk of tensor `name` carries against its `data`: DataLoss on a mismatch,
    FailedPrecondition for a CRC-32C this process cannot compute."""
    for kind in ("crc32c", "crc32"):
        if not chunk.HasField(kind):
            continue
        what = f"tensor {name!r}: chunk at offset {chunk.offset} ({len(data)} bytes)"
        if kind == "crc32c" and _crc32c is None:
            raise FailedPrecondition(f"{what} carries a CRC-32C, which this process cannot check without the crc32c "
                                     "package (pip install crc32c); or start the sender with --checksums crc32")
        sent, received = getattr(chunk, kind), _value(kind, data)
        if sent != received:
            raise DataLoss(f"{what} fails its {NAMES[kind]} check (sent {sent:#010x}, received {received:#010x})")
