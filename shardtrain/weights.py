"""Model weights read where they lie, by the shard that holds them: each stage reads only its own tensors.

A source is a safetensors file, a Hugging Face sharded checkpoint (`model.safetensors.index.json` beside its
`model-0000k-of-0000n.safetensors` files, or the index itself), or a directory holding either or any safetensors
files, on a local disk or anywhere fsspec reaches ("s3://bucket/model/"). Only the headers of the files that hold
the stage's tensors are read, every tensor is checked against the stage (name, dtype, shape) before a byte of data
is, and the data comes a bounded batch at a time: from a local file through the safetensors library, which maps
it, from object storage as byte ranges. Every URL is confined to the shard's data roots.
"""

from __future__ import annotations

import json
import math
import posixpath
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import fsspec
import torch

from shardtrain import data_files, tensor_files
from shardtrain.errors import DataLoss, InvalidArgument, NotFound

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_INDEX_BYTES = 64 << 20
MAX_FILES = 4096
BATCH_BYTES = 64 << 20  # read and copied into the stage this much at a time: a stage's peak is its weights + this


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file's URL, its name there, its dtype and shape, and its bytes [begin, end) in
    the file for a ranged read of object storage (0 and its size in a local file, which the library reads)."""

    url: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _url(protocol: str | None, path: str) -> str:
    return path if protocol in data_files.LOCAL else f"{protocol}://{path}"


def _files(source: str, roots) -> tuple[list[str], dict[str, str] | None]:
    """(the safetensors files of `source`, the index's map of tensor name to file, or None without an index)."""
    fs, path = data_files.filesystem(source)
    protocol = fsspec.core.split_protocol(source)[0]
    path = path.rstrip("/")
    if path.endswith(".safetensors"):
        return [_url(protocol, path)], None
    index = path if path.endswith(".json") else posixpath.join(path, INDEX)
    if path.endswith(".json") or fs.exists(index):
        return _index(fs, protocol, index, roots)
    if not fs.isdir(path):
        raise NotFound(f"weights {source[:200]!r}: no such file or directory")
    if fs.exists(posixpath.join(path, SINGLE)):
        return [_url(protocol, posixpath.join(path, SINGLE))], None
    found = sorted(name for name in fs.glob(posixpath.join(path, "*.safetensors")))
    if not found:
        raise NotFound(f"weights {source[:200]!r}: a directory without {INDEX}, {SINGLE} or any .safetensors file")
    return [_url(protocol, name) for name in found[:MAX_FILES]], None


def _index(fs, protocol, index: str, roots) -> tuple[list[str], dict[str, str]]:
    """A sharded checkpoint's index: its files (plain names beside it) and its map of tensor name to file."""
    data_files.check_allowed(_url(protocol, index), roots)
    try:
        if fs.size(index) > MAX_INDEX_BYTES:
            raise DataLoss(f"weights index {index[:200]!r} is larger than {MAX_INDEX_BYTES} bytes")
        described = json.loads(fs.cat_file(index))
    except OSError as error:
        raise data_files.storage_error(error, f"weights index {index[:200]!r}") from None
    except ValueError as error:
        raise DataLoss(f"weights index {index[:200]!r} is not JSON: {error}") from None
    weight_map = described.get("weight_map") if isinstance(described, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise DataLoss(f"weights index {index[:200]!r} has no weight_map of tensor names to file names")
    folder = posixpath.dirname(index)
    files = {}
    for name in sorted(set(weight_map.values())):
        if "/" in name or name in ("", ".", "..") or not name.endswith(".safetensors"):
            raise DataLoss(f"weights index {index[:200]!r} names file {name[:200]!r}; files are .safetensors "
                           "names beside the index")
        files[name] = _url(protocol, posixpath.join(folder, name))
    return list(files.values())[:MAX_FILES], {key: files[name] for key, name in weight_map.items()}


def locate(source: str, keys: Mapping[str, tuple[str, ...]], roots) -> dict[str, Entry]:
    """Where each wanted tensor lies: `keys` maps each key the stage needs to the names it may have in the source
    (its own first, then a tied weight's other keys). Reads the headers of the files that may hold them only.
    Keys found under none of their names are left out (the caller names them)."""
    data_files.check_allowed(source, roots)
    files, weight_map = _files(source, roots)
    if weight_map is not None:
        named = {name for names in keys.values() for name in names}
        files = sorted({weight_map[name] for name in named if name in weight_map})
    found: dict[str, Entry] = {}
    for url in files:
        data_files.check_allowed(url, roots)
        for name, entry in _header(url).items():
            if name in found and found[name].url != url:
                raise DataLoss(f"weights {source[:200]!r}: tensor {name!r} is in both {found[name].url!r} and "
                               f"{url!r}")
            found[name] = entry
    located = {}
    for key, names in keys.items():
        name = next((name for name in names if name in found), None)
        if name is not None:
            located[key] = found[name]
    return located


def _header(url: str) -> dict[str, Entry]:
    path = data_files.local_path(url)
    try:
        if path is not None:
            return {name: Entry(url, name, dtype, tuple(shape), 0, math.prod(shape) * dtype.itemsize)
                    for name, (dtype, shape) in tensor_files.local_entries(path, "weights file").items()}
        fs, path = data_files.filesystem(url)
        size = fs.size(path)
        with fs.open(path, "rb", block_size=1 << 16) as file:
            entries = tensor_files.header_entries(file, size, url, "weights file")
    except OSError as error:
        raise data_files.storage_error(error, f"weights file {url[:200]!r}") from None
    return {name: Entry(url, name, dtype, tuple(shape), begin, end)
            for name, (dtype, shape, begin, end) in entries.items()}


def plan(source: str, keys: Mapping[str, tuple[str, ...]], expected: Mapping[str, torch.Tensor], roots,
         holder: str) -> dict[str, Entry]:
    """Where each tensor `holder` (a stage) needs lies (locate), every one found and checked against `expected`
    before any data is read: InvalidArgument naming the first tensor missing or of another dtype or shape."""
    located = locate(source, keys, roots)
    missing = sorted(set(keys) - set(located))
    if missing:
        tied = keys[missing[0]][1:]
        raise InvalidArgument(f"weights {source[:200]!r} hold no tensor {missing[0]!r}"
                              f"{f' (nor its tied {list(tied)})' if tied else ''} of {holder}: "
                              f"{len(missing)} of its {len(keys)} missing, e.g. {missing[:5]}")
    check(located, expected, source)
    return located


def check(located: Mapping[str, Entry], expected: Mapping[str, torch.Tensor], source: str) -> None:
    """InvalidArgument, before any data is read, naming the first tensor whose dtype or shape is not the stage's."""
    for key, entry in located.items():
        want = expected[key]
        if entry.dtype != want.dtype or entry.shape != tuple(want.shape):
            raise InvalidArgument(f"weights {source[:200]!r}: tensor {key!r} is a {entry.dtype} of shape "
                                  f"{list(entry.shape)} in {entry.url[:200]!r}; the stage holds a {want.dtype} of "
                                  f"shape {list(want.shape)}")


def batches(located: Mapping[str, Entry], limit: int = BATCH_BYTES) -> Iterator[dict[str, Entry]]:
    """The located tensors in batches of about `limit` bytes (one larger tensor alone), file by file."""
    batch, size = {}, 0
    for key, entry in sorted(located.items(), key=lambda item: (item[1].url, item[1].begin)):
        if batch and size + entry.end - entry.begin > limit:
            yield batch
            batch, size = {}, 0
        batch[key] = entry
        size += entry.end - entry.begin
    if batch:
        yield batch


def read(batch: Mapping[str, Entry]) -> dict[str, torch.Tensor]:
    """The batch's tensors, from local files through the library (mapped: to be copied, not kept) and from object
    storage each as its own byte range (data.fetch), as read-only views of the bytes read: to be copied, not
    written."""
    tensors: dict[str, torch.Tensor] = {}
    local: dict[str, list[str]] = {}
    for key, entry in batch.items():
        if data_files.local_path(entry.url) is not None:
            local.setdefault(entry.url, []).append(key)
    for url, keys in local.items():
        try:
            read_here = tensor_files.read_tensors(data_files.local_path(url), [batch[key].name for key in keys],
                                                  "weights file")
        except OSError as error:
            raise data_files.storage_error(error, f"weights file {url[:200]!r}") from None
        tensors.update(zip(keys, read_here))
    remote = {key: entry for key, entry in batch.items() if key not in tensors}
    blobs = data_files.fetch([(entry.url, entry.begin, entry.end) for entry in remote.values()], "weights")
    for (key, entry), blob in zip(remote.items(), blobs):
        if len(blob) != entry.end - entry.begin:
            raise DataLoss(f"weights file {entry.url[:200]!r} ended inside tensor {key!r}")
        with warnings.catch_warnings():  # read-only: the stage copies it into its own weights
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensors[key] = torch.frombuffer(blob, dtype=torch.uint8).view(entry.dtype).reshape(entry.shape) \
                if blob else torch.empty(entry.shape, dtype=entry.dtype)
    return {key: tensors[key] for key in batch}
