"""shardtrain.tensor_files: every safetensors dtype torch has, written and read locally by the library and read as
byte ranges from object storage (an in-memory fsspec filesystem stands in for S3); dtypes neither takes are named."""

from __future__ import annotations

import json
import stat
import struct

import fsspec
import pytest
import safetensors.torch
import torch

from shardtrain import data_files, tensor_files, weights
from shardtrain.errors import DataLoss, InvalidArgument
from shardtrain.v1 import shard_pb2

DTYPES = sorted(tensor_files.DTYPES.items())


def sample(dtype: torch.dtype, shape=(4, 3)) -> torch.Tensor:
    """Random bytes of `dtype` (0 or 1 for bool): compared byte for byte, so NaN payloads compare too."""
    count = torch.Size(shape).numel() * dtype.itemsize
    high = 2 if dtype == torch.bool else 256
    return torch.randint(0, high, (count,), dtype=torch.uint8).view(dtype).reshape(shape)


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def test_every_dtype_the_library_reads_is_taken():
    assert {"U16", "U32", "U64", "C64", "F8_E4M3", "F8_E5M2", "BF16", "BOOL"} <= set(tensor_files.DTYPES)


@pytest.mark.parametrize("name,dtype", DTYPES)
def test_every_dtype_round_trips_locally_and_the_library_agrees(tmp_path, name, dtype):
    tensors = {"t": sample(dtype), "scalar": sample(dtype, ()), "empty": sample(dtype, (0, 2))}
    path = tmp_path / "t.safetensors"
    tensor_files.write(path, tensors, {"note": "x"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not list(tmp_path.glob("*.partial"))
    read, metadata = tensor_files.read(path)
    assert metadata == {"note": "x"}
    theirs = safetensors.torch.load_file(str(path))
    for key, tensor in tensors.items():
        assert read[key].dtype == theirs[key].dtype == dtype and read[key].shape == tensor.shape
        assert torch.equal(raw(read[key]), raw(tensor)) and torch.equal(raw(theirs[key]), raw(tensor))
    shapes, _ = tensor_files.read(path, lambda key: key == "t", meta=True)
    assert list(shapes) == ["t"] and shapes["t"].device.type == "meta" and shapes["t"].dtype == dtype


@pytest.fixture
def bucket():
    """An in-memory filesystem, read as object storage is: by byte ranges after the header."""
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/bucket"):
        fs.rm("/bucket", recursive=True)


@pytest.mark.parametrize("name,dtype", DTYPES)
def test_every_dtype_reads_through_the_ranged_reader_as_weights_and_as_data_rows(bucket, name, dtype):
    tensors = {"layer.weight": sample(dtype), "rows": sample(dtype, (5, 2))}
    bucket.pipe("/bucket/model.safetensors", safetensors.torch.save(tensors))
    url = "memory:///bucket/model.safetensors"
    located = weights.locate(url, {"w": ("layer.weight",)}, [data_files.normalized_root("memory:///bucket/")])
    assert located["w"].dtype == dtype and located["w"].end - located["w"].begin == tensors["layer.weight"].nbytes
    assert torch.equal(raw(weights.read(located)["w"]), raw(tensors["layer.weight"]))
    rows = shard_pb2.DataRows(format="safetensors", field="rows", spans=[shard_pb2.DataSpan(url=url, rows=[4, 0, 1])])
    assert torch.equal(raw(data_files.read(rows, data_files.HeaderCache())), raw(tensors["rows"][[4, 0, 1]]))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.float8_e4m3fn])
def test_local_weights_and_data_rows_of_uint16_and_float8_read(tmp_path, dtype):
    tensors = {"layer.weight": sample(dtype), "rows": sample(dtype, (5, 2))}
    tensor_files.write(tmp_path / "model.safetensors", tensors)
    url = str(tmp_path / "model.safetensors")
    located = weights.locate(url, {"w": ("layer.weight",)}, [data_files.normalized_root(str(tmp_path))])
    assert torch.equal(raw(weights.read(located)["w"]), raw(tensors["layer.weight"]))
    rows = shard_pb2.DataRows(format="safetensors", field="rows", spans=[shard_pb2.DataSpan(url=url, rows=[3, 4, 0])])
    assert torch.equal(raw(data_files.read(rows, data_files.HeaderCache())), raw(tensors["rows"][[3, 4, 0]]))


def with_dtype(encoded: bytes, name: str) -> bytes:
    """A safetensors file's bytes with its first tensor's dtype name replaced (the header keeps its length)."""
    size = struct.unpack_from("<Q", encoded)[0]
    header = json.loads(encoded[8:8 + size])
    first = next(key for key in header if key != "__metadata__")
    header[first]["dtype"] = name
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(text) == size
    return encoded[:8] + text + encoded[8 + size:]


def test_an_unknown_dtype_is_named_by_either_reader(tmp_path, bucket):
    encoded = with_dtype(safetensors.torch.save({"t": torch.zeros(4, dtype=torch.int8)}), "X9")
    bucket.pipe("/bucket/odd.safetensors", encoded)
    with pytest.raises(InvalidArgument, match=r"tensor 't' has dtype 'X9', which this reader does not take"):
        weights.locate("memory:///bucket/odd.safetensors", {"t": ("t",)}, ["memory:///bucket/"])
    (tmp_path / "odd.safetensors").write_bytes(encoded)
    with pytest.raises(DataLoss, match=r"odd.safetensors is not a whole safetensors file .*X9"):
        tensor_files.read(tmp_path / "odd.safetensors")


def test_names_over_the_same_bytes_are_written_apart_and_unknown_dtypes_refused(tmp_path):
    shared = torch.arange(6.0)
    tensor_files.write(tmp_path / "tied.safetensors", {"a": shared, "b": shared, "half": shared[:3]})
    read, _ = tensor_files.read(tmp_path / "tied.safetensors")
    assert all(torch.equal(read[key], value) for key, value in (("a", shared), ("b", shared), ("half", shared[:3])))
    with pytest.raises(InvalidArgument, match="torch.complex128"):
        tensor_files.write(tmp_path / "wide.safetensors", {"z": torch.zeros(2, dtype=torch.complex128)})
    assert not list(tmp_path.glob("wide*"))
