"""safetensors files: local ones read and written by the safetensors library, remote ones read as byte ranges.

The library maps a local file and hands out the tensors asked for. A file in object storage (s3:// through
fsspec) is read by its header alone, parsed here, then only the byte ranges of the tensors wanted are fetched
(data.fetch); the parser takes every dtype the library does, so either way reads the same files. Writes go
through the library into bytes, then through checkpoint_store's files: owner-only (or the configured group),
synced, and renamed into place.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from collections.abc import Callable

import safetensors
import safetensors.torch
import torch

from shardtrain import checkpoint_store as store
from shardtrain.errors import DataLoss, InvalidArgument, NotFound

# Every dtype of the safetensors format that the library reads back as a torch tensor, by its name in headers
# (torch builds without the float8 types simply lack those).
_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "C64": "complex64",
          "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
          "U16": "uint16", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
          "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz"}
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attribute) for name, attribute in _NAMES.items()
                                  if hasattr(torch, attribute)}
_FORMAT_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20


def dtype_of(name, what: str) -> torch.dtype:
    """The torch dtype of a header's dtype name; InvalidArgument naming it and `what` when it is none of DTYPES."""
    if name not in DTYPES:
        raise InvalidArgument(f"{what} has dtype {str(name)[:40]!r}, which this reader does not take; it takes "
                              f"{sorted(DTYPES)}")
    return DTYPES[name]


def write(path: pathlib.Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
          access: store.Access = store.PRIVATE) -> int:
    """Writes `tensors` (and `metadata`, strings) to `path` as a safetensors file, through a temporary file
    renamed into place, readable as `access` says; returns the bytes written. A failure leaves no temporary
    file."""
    for name, tensor in tensors.items():
        if tensor.dtype not in _FORMAT_NAMES:
            raise InvalidArgument(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors files here do not "
                                  f"hold ({sorted(str(d) for d in _FORMAT_NAMES)})")
    encoded = safetensors.torch.save(_apart(tensors), metadata or None)
    temporary = path.with_name(path.name + ".partial")
    try:
        with store.new_file(temporary, access) as out:  # synced: on disk before checkpoint.json can name it
            out.write(encoded)
        os.replace(temporary, path)
    except BaseException:
        store.remove(temporary)
        raise
    return len(encoded)


def _apart(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, a copy of each that overlaps the bytes of one before it (a weight tied under two
    names): the library stores no two names over the same bytes."""
    taken: dict[int, list[tuple[int, int]]] = {}
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        areas = taken.setdefault(tensor.untyped_storage().data_ptr(), [])
        if size and any(start < end and begin < start + size for begin, end in areas):
            tensor = tensor.clone()
            start = tensor.data_ptr()
            areas = taken.setdefault(tensor.untyped_storage().data_ptr(), [])
        areas.append((start, start + size))
        out[name] = tensor
    return out


def read(path: pathlib.Path, wanted: Callable[[str], bool] | None = None, meta: bool = False,
         what: str = "checkpoint") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the tensors whose name `wanted` accepts, the metadata) of a local safetensors file, through the library,
    which maps the file: only the tensors taken are read. With `meta`, tensors on the meta device (dtypes and
    shapes, for a check) and no data. NotFound for a missing file, DataLoss for one that is not whole."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            tensors = {}
            for name in file.offset_keys():
                if wanted is not None and not wanted(name):
                    continue
                if meta:
                    view = file.get_slice(name)
                    dtype = dtype_of(view.get_dtype(), f"{what}: {path}: tensor {name!r}")
                    tensors[name] = torch.empty(view.get_shape(), dtype=dtype, device="meta")
                else:
                    dtype_of(file.get_slice(name).get_dtype(), f"{what}: {path}: tensor {name!r}")
                    tensors[name] = file.get_tensor(name)
    except FileNotFoundError:
        raise NotFound(f"{what}: {path} is missing") from None
    except safetensors.SafetensorError as error:
        raise DataLoss(f"{what}: {path} is not a whole safetensors file ({str(error)[:300]})") from None
    return tensors, metadata


def local_entries(path: str, what: str) -> dict[str, tuple[torch.dtype, list[int]]]:
    """Every tensor of a local safetensors file by name, (dtype, shape), in the order of its bytes; DataLoss
    naming `what` (e.g. "data file") when the file is not one."""
    try:
        with safetensors.safe_open(path, framework="pt") as file:
            return {name: (dtype_of(view.get_dtype(), f"{what} {path[:200]!r}: tensor {name!r}"), view.get_shape())
                    for name in file.offset_keys() for view in (file.get_slice(name),)}
    except safetensors.SafetensorError as error:
        raise DataLoss(f"{what} {path[:200]!r} is not a whole safetensors file ({str(error)[:300]})") from None


def read_rows(path: str, name: str, runs: list[tuple[int, int]], what: str) -> torch.Tensor:
    """Rows [first, last] of each run of tensor `name` of a local safetensors file, one after another."""
    try:
        with safetensors.safe_open(path, framework="pt") as file:
            view = file.get_slice(name)
            return torch.cat([view[first:last + 1] for first, last in runs])
    except safetensors.SafetensorError as error:
        raise DataLoss(f"{what} {path[:200]!r} is not a whole safetensors file ({str(error)[:300]})") from None


def read_tensors(path: str, names: list[str], what: str) -> list[torch.Tensor]:
    """Tensors `names` of a local safetensors file, each read alone."""
    try:
        with safetensors.safe_open(path, framework="pt") as file:
            return [file.get_tensor(name) for name in names]
    except safetensors.SafetensorError as error:
        raise DataLoss(f"{what} {path[:200]!r} is not a whole safetensors file ({str(error)[:300]})") from None


# --- the header parser, for ranged reads of remote files ------------------------------------------------------

def _header(file, length: int, what: str) -> tuple[dict, int]:
    """(the JSON header, its size) of a safetensors file of `length` bytes, `file` open at its start; DataLoss
    naming `what` when it is not one."""
    raw = file.read(8)
    if len(raw) < 8:
        raise DataLoss(f"{what} is too short to be a safetensors file")
    size = struct.unpack_from("<Q", raw)[0]
    if size > min(MAX_HEADER_BYTES, length - 8):
        raise DataLoss(f"{what} says its header has {size} bytes; the file has {length}")
    try:
        header = json.loads(file.read(size))
    except ValueError as error:
        raise DataLoss(f"{what}: its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise DataLoss(f"{what}: its header is not a JSON object")
    return header, size


def _entry(what: str, name: str, entry, data_length: int) -> tuple[torch.dtype, list[int], int, int]:
    """A header entry's (dtype, shape, begin, end), checked against the bytes the file has."""
    try:
        kind, shape = entry["dtype"], [int(d) for d in entry["shape"]]
        begin, end = (int(offset) for offset in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise DataLoss(f"{what}: tensor {name!r} has a malformed entry {str(entry)[:200]}") from None
    dtype = dtype_of(kind, f"{what}: tensor {name!r}")
    numel = 1
    for dim in shape:
        numel *= dim
    if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_length or \
            end - begin != numel * dtype.itemsize:
        raise DataLoss(f"{what}: tensor {name!r} ({kind}, {shape}) does not match its bytes [{begin}, {end}) of "
                       f"the {data_length} after the header")
    return dtype, shape, begin, end


def header_entries(file, size: int, path: str, what: str) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """Every tensor of a safetensors file of `size` bytes (open at its start) by name: (dtype, shape, begin, end)
    with begin and end counted from the file's start; DataLoss naming `what` (e.g. "data file") when it is not
    one."""
    where = f"{what} {path[:200]!r}"
    header, length = _header(file, size, where)
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(where, name, entry, size - 8 - length)
        entries[name] = (dtype, shape, 8 + length + begin, 8 + length + end)
    return entries
