"""Training data in files, read by rows: the SDK plans batches from the files' headers, and a shard reads its share
of each batch (a DataRows message) straight from storage, so no batch passes through the client.

Files are safetensors (each holds every field, rows on dim 0) or NumPy .npy (one field a file), anywhere fsspec
reaches: a local path, "file://" or "local://" URLs, "s3://bucket/prefix/" with s3fs (credentials and endpoint
from the usual AWS_* environment variables). A read takes only the rows it needs, adjacent rows as one range: a
local safetensors file through the safetensors library, which maps it, any other file as byte ranges. A shard
reads only under the directories and URL prefixes it was started with (--data-root).
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import fsspec
import numpy
from fsspec.implementations.local import LocalFileSystem
import torch

from shardtrain import tensor_files
from shardtrain.errors import (DataLoss, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied,
                               ShardtrainError, Unavailable)
from shardtrain.v1 import shard_pb2

FORMATS = {".safetensors": "safetensors", ".npy": "npy"}
LOCAL = (None, "file", "local")
MAX_SPANS = 1 << 16
MAX_ROWS = 1 << 24


@dataclass(frozen=True)
class Field:
    """One tensor of a data file: its dtype, the shape of one row, its row count, and where row 0 starts (for
    byte-range reads; 0 in a local safetensors file, which the library reads)."""

    dtype: torch.dtype
    row_shape: tuple[int, ...]
    rows: int
    offset: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * torch.empty(0, dtype=self.dtype).element_size()


def filesystem(url: str):
    """(fsspec filesystem, path within it) of a URL or local path; FailedPrecondition when the protocol's package
    is missing (s3fs for s3://)."""
    if "::" in url:
        raise InvalidArgument(f"data URL {url[:200]!r}: chained URLs (with '::') are not taken; name the files")
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as error:
        raise FailedPrecondition(f"reading {url[:200]!r} needs a package this process lacks ({error}); for s3:// "
                                 "install s3fs (pip install 'shardtrain[s3]')") from None
    except ValueError as error:
        raise InvalidArgument(f"data URL {url[:200]!r}: {error}") from None


def format_of(path: str) -> str:
    """"safetensors" or "npy", from a file name's suffix."""
    suffix = os.path.splitext(path)[1]
    if suffix not in FORMATS:
        raise InvalidArgument(f"data file {path[:200]!r}: its format is not known from its name; files are "
                              f"{sorted(FORMATS)}")
    return FORMATS[suffix]


def inspect(fs, path: str, format: str) -> dict[str, Field]:
    """The fields of a data file from its header alone: a safetensors file's tensors by name, or an .npy file's
    one array (under the name ""). DataLoss for a header that is not one; NotFound for a missing file."""
    try:
        size = fs.size(path)
        with fs.open(path, "rb", block_size=1 << 16) as file:
            if format == "safetensors":
                return _safetensors_fields(fs, file, size, path)
            if format == "npy":
                return {"": _npy_field(file, size, path)}
    except OSError as error:
        raise storage_error(error, f"data file {path[:200]!r}") from None
    except ValueError as error:
        raise DataLoss(f"data file {path[:200]!r} could not be read: {error}") from None
    raise InvalidArgument(f"data format {format[:40]!r} is not one of {sorted(FORMATS.values())}")


def _safetensors_fields(fs, file, size: int, path: str) -> dict[str, Field]:
    if isinstance(fs, LocalFileSystem):
        return {name: Field(dtype, tuple(shape[1:]), shape[0], 0)  # a scalar has no rows: not a field
                for name, (dtype, shape) in tensor_files.local_entries(path, "data file").items() if shape}
    return {name: Field(dtype, tuple(shape[1:]), shape[0], begin)
            for name, (dtype, shape, begin, _) in tensor_files.header_entries(file, size, path, "data file").items()
            if shape}


def local_path(url: str) -> str | None:
    """The path of `url` on this host's own filesystem, or None for object storage, read as byte ranges."""
    fs, path = filesystem(url)
    return path if isinstance(fs, LocalFileSystem) else None


def _npy_field(file, size: int, path: str) -> Field:
    try:
        version = numpy.lib.format.read_magic(file)
        read_header = numpy.lib.format.read_array_header_1_0 if version == (1, 0) else \
            numpy.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(file)
    except ValueError as error:
        raise DataLoss(f"data file {path[:200]!r} is not a NumPy .npy file ({error})") from None
    if fortran or not shape:
        raise DataLoss(f"data file {path[:200]!r}: an array of rows in C order is needed (shape {shape}, "
                       f"fortran_order {fortran})")
    if dtype.hasobject or not dtype.isnative:
        raise DataLoss(f"data file {path[:200]!r}: dtype {dtype} is not a plain little-endian number type")
    try:
        torch_dtype = torch.from_numpy(numpy.empty(0, dtype=dtype)).dtype
    except TypeError:
        raise DataLoss(f"data file {path[:200]!r}: dtype {dtype} has no torch counterpart") from None
    field = Field(torch_dtype, tuple(shape[1:]), shape[0], file.tell())
    if field.offset + field.rows * field.row_bytes > size:
        raise DataLoss(f"data file {path[:200]!r}: its header declares shape {shape}, more than its {size} bytes")
    return field


class HeaderCache:
    """The fields of files read lately, so that a batch's read costs no header round trip. Data files are taken
    as immutable while a run reads them."""

    def __init__(self, capacity: int = 4096):
        self._entries: OrderedDict[tuple[str, str], dict[str, Field]] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def fields(self, url: str, format: str) -> dict[str, Field]:
        key = (url, format)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        fs, path = filesystem(url)
        found = inspect(fs, path, format)
        with self._lock:
            self._entries[key] = found
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return found


def field_of(fields: dict[str, Field], format: str, name: str, url: str) -> Field:
    """Field `name` among a file's fields (an .npy file has only one, whatever the name)."""
    if format == "npy":
        return fields[""]
    if name not in fields:
        raise InvalidArgument(f"data file {url[:200]!r} has no tensor {name[:100]!r}; it holds "
                              f"{sorted(fields)[:20]}")
    return fields[name]


def describe(rows: shard_pb2.DataRows, cache: HeaderCache) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, bytes) of the tensor a DataRows stands for, from the files' headers; InvalidArgument for
    rows outside a file or files whose fields disagree."""
    if rows.format not in FORMATS.values():
        raise InvalidArgument(f"data rows: format {rows.format[:40]!r} is not one of {sorted(FORMATS.values())}")
    if not 1 <= len(rows.spans) <= MAX_SPANS:
        raise InvalidArgument(f"data rows: 1 to {MAX_SPANS} spans are needed, got {len(rows.spans)}")
    first, count = None, 0
    for span in rows.spans:
        field = field_of(cache.fields(span.url, rows.format), rows.format, rows.field, span.url)
        first = first or field
        if (field.dtype, field.row_shape) != (first.dtype, first.row_shape):
            raise InvalidArgument(f"data rows of {rows.field!r}: {span.url[:200]!r} holds {field.dtype} rows of shape "
                                  f"{list(field.row_shape)}, other files {first.dtype} rows of {list(first.row_shape)}")
        if any(not 0 <= row < field.rows for row in span.rows):
            raise InvalidArgument(f"data rows: {span.url[:200]!r} has rows 0..{field.rows - 1}; asked for "
                                  f"{[r for r in span.rows if not 0 <= r < field.rows][:5]}")
        count += len(span.rows)
    if not 1 <= count <= MAX_ROWS:
        raise InvalidArgument(f"data rows: 1 to {MAX_ROWS} rows are needed, got {count}")
    return first.dtype, (count, *first.row_shape), count * first.row_bytes


def read(rows: shard_pb2.DataRows, cache: HeaderCache) -> torch.Tensor:
    """The tensor a DataRows stands for: each span's rows from its file, adjacent rows as one range (a local
    safetensors file's through the library, other files' as byte ranges, every range of a filesystem fetched in
    one concurrent call), in the order the spans give them."""
    describe(rows, cache)  # every file's header and every row checked before a byte of data is fetched
    plans, ranges = [], []
    for span in rows.spans:
        field = field_of(cache.fields(span.url, rows.format), rows.format, rows.field, span.url)
        order = torch.tensor(list(span.rows), dtype=torch.int64)
        unique, position = torch.unique(order, return_inverse=True)  # sorted; position: each row's place in it
        runs = _runs(unique.tolist())
        path = local_path(span.url) if rows.format == "safetensors" else None
        if path is None:
            ranges.extend((span.url, field.offset + first * field.row_bytes,
                           field.offset + (last + 1) * field.row_bytes) for first, last in runs)
        plans.append((field, path, runs, len(unique), position))
    blobs = iter(fetch(ranges, f"data rows of {rows.field!r}"))
    pieces = []
    for field, path, runs, distinct, position in plans:
        if path is not None:
            pieces.append(tensor_files.read_rows(path, rows.field, runs, "data file")[position])
            continue
        data = b"".join(next(blobs) for _ in runs)
        if len(data) != distinct * field.row_bytes:
            raise DataLoss(f"data rows of {rows.field!r}: a file ended before the rows its header declares")
        rows_read = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(field.dtype) \
            .reshape(-1, *field.row_shape) if data else torch.empty(0, *field.row_shape, dtype=field.dtype)
        pieces.append(rows_read[position])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def fetch(ranges: Sequence[tuple[str, int, int]], what: str) -> list[bytes]:
    """The bytes [start, end) of each (url, start, end), in the order given; every range of one filesystem is
    fetched in one concurrent call. A storage failure is the status storage_error gives, naming `what`."""
    by_filesystem: dict[int, tuple[object, list[tuple[int, str, int, int]]]] = {}
    for index, (url, start, end) in enumerate(ranges):
        fs, path = filesystem(url)
        by_filesystem.setdefault(id(fs), (fs, []))[1].append((index, path, start, end))
    blobs: list[bytes] = [b""] * len(ranges)
    for fs, wanted in by_filesystem.values():
        try:
            fetched = fs.cat_ranges([w[1] for w in wanted], [w[2] for w in wanted], [w[3] for w in wanted],
                                    on_error="raise")
        except OSError as error:
            raise storage_error(error, what) from None
        for (index, *_), blob in zip(wanted, fetched):
            blobs[index] = blob
    return blobs


def storage_error(error: BaseException, what: str) -> ShardtrainError:
    """The status for a storage client's failure: a missing file NOT_FOUND, a refusal PERMISSION_DENIED, the rest
    (network, throttling, a client library's own errors) UNAVAILABLE: another try may work."""
    if isinstance(error, FileNotFoundError):
        return NotFound(f"{what}: no such file ({error})")
    if isinstance(error, PermissionError):
        return PermissionDenied(f"{what}: the storage refused this process ({error}); check its credentials")
    return Unavailable(f"{what}: reading failed: {type(error).__name__}: {error}")


def _runs(sorted_rows: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive rows as (first, last) runs."""
    runs: list[tuple[int, int]] = []
    for row in sorted_rows:
        if runs and row == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], row)
        else:
            runs.append((row, row))
    return runs


def normalized_root(root: str) -> str:
    """A --data-root as the shard compares URLs with it: a local directory resolved (symbolic links included), a
    URL prefix as given, ending with "/"."""
    protocol, path = fsspec.core.split_protocol(root)
    if protocol in LOCAL:
        return os.path.realpath(path)
    if ".." in path.split("/"):
        raise InvalidArgument(f"data root {root[:200]!r} may not contain '..'")
    return f"{protocol}://{path.rstrip('/')}/"


def check_allowed(url: str, roots: Sequence[str]) -> None:
    """PermissionDenied unless `url` lies under one of `roots` (normalized_root's); FailedPrecondition when the
    shard has none."""
    if not roots:
        raise FailedPrecondition("this shard reads no training data itself: start it with --data-root DIR or URL "
                                 "prefix (or SHARDTRAIN_DATA_ROOTS), or send the batches from the client")
    if not url or "\0" in url or len(url) > 4096:
        raise InvalidArgument("data URL: a file's URL of 1 to 4096 characters is needed")
    if "::" in url:
        raise InvalidArgument(f"data URL {url[:200]!r}: chained URLs (with '::') are not taken; name the file")
    protocol, path = fsspec.core.split_protocol(url)
    if protocol in LOCAL:
        target = os.path.realpath(path)
        if any(os.path.isdir(root) and os.path.commonpath([root, target]) == root for root in roots):
            return
    elif ".." not in path.split("/") and any(f"{protocol}://{path}".startswith(root) for root in roots
                                             if "://" in root):
        return
    raise PermissionDenied(f"data file {url[:200]!r} is outside this shard's data roots ({', '.join(roots)})")


class Reader:
    """A shard's reads of DataRows: confined to its data roots, headers cached."""

    def __init__(self, roots: Sequence[str]):
        self.roots = [normalized_root(root) for root in roots]
        self._cache = HeaderCache()

    def describe(self, rows: shard_pb2.DataRows) -> tuple[torch.dtype, tuple[int, ...], int]:
        """What the rows will be (dtype, shape, bytes), after every URL was checked against the data roots."""
        return self._confined(describe, rows)

    def read(self, rows: shard_pb2.DataRows) -> torch.Tensor:
        return self._confined(read, rows)

    def _confined(self, work, rows: shard_pb2.DataRows):
        for span in rows.spans:
            check_allowed(span.url, self.roots)
        try:
            return work(rows, self._cache)
        except ShardtrainError:
            raise
        except Exception as error:  # noqa: BLE001 - a storage client's own error (botocore's), named for the caller
            raise storage_error(error, f"data rows of {rows.field!r}") from None
