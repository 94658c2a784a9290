"""Data files read by rows (shardtrain.data_files) and the SDK's DataSource plan: headers, byte ranges, order,
shuffling, the shard's data roots."""

from __future__ import annotations

import os

import numpy
import pytest
import torch

from client_sdk.data_source import DataSource
from shardtrain import data_files
from shardtrain.checkpoint import write_safetensors
from shardtrain.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from shardtrain.settings import shard_settings
from shardtrain.v1 import shard_pb2


@pytest.fixture
def parts(tmp_path):
    """Three safetensors files of 5, 7 and 4 rows: x holds each row's global number, y twice that."""
    start = 0
    for index, rows in enumerate((5, 7, 4)):
        x = torch.arange(start, start + rows, dtype=torch.float32).repeat_interleave(3).reshape(rows, 3)
        write_safetensors(tmp_path / f"part-{index}.safetensors", {"x": x, "y": 2 * x[:, :1].long()})
        start += rows
    return tmp_path


def rows_message(path, field, rows, format="safetensors"):
    return shard_pb2.DataRows(format=format, field=field, spans=[shard_pb2.DataSpan(url=str(path), rows=rows)])


def test_rows_are_read_in_the_order_asked_repeats_included_from_byte_ranges(parts):
    tensor = data_files.read(rows_message(parts / "part-1.safetensors", "x", [6, 0, 1, 2, 6, 4]),
                             data_files.HeaderCache())
    assert tensor[:, 0].tolist() == [11, 5, 6, 7, 11, 9] and tensor.shape == (6, 3)
    assert data_files._runs([0, 1, 2, 4, 6, 7]) == [(0, 2), (4, 4), (6, 7)]


def test_a_data_source_plans_the_same_rows_for_any_split_and_reads_them(parts):
    source = DataSource(str(parts) + "/", batch_size=6, seed=7)
    assert source.rows == 16 and len(source) == 3 and source.format == "safetensors"
    first, again = source.epoch(0), DataSource(f"local://{parts}/*.safetensors", batch_size=6, seed=7).epoch(0)
    assert all(torch.equal(a.rows, b.rows) for a, b in zip(first, again))
    assert not torch.equal(torch.cat([b.rows for b in first]), torch.cat([b.rows for b in source.epoch(1)]))
    assert sorted(torch.cat([b.rows for b in first]).tolist()) == list(range(16))
    x, y = first[0].read()
    assert x[:, 0].tolist() == first[0].rows.float().tolist() and torch.equal(y[:, 0], 2 * first[0].rows)
    message = source.rows_message("x", torch.tensor([4, 5, 6, 15, 0]))  # files 0, 1, 1, 2, 0: four spans
    assert [(os.path.basename(s.url), list(s.rows)) for s in message.spans] == [
        ("part-0.safetensors", [4]), ("part-1.safetensors", [0, 1]), ("part-2.safetensors", [3]),
        ("part-0.safetensors", [0])]
    assert [len(b) for b in DataSource(str(parts), batch_size=6, shuffle=False, drop_last=True)] == [6, 6]
    passes = DataSource(str(parts), batch_size=16)
    assert not torch.equal(next(iter(passes)).rows, next(iter(passes)).rows)  # each iteration is the next pass


def test_npy_files_are_one_field_each_named_by_the_url(tmp_path):
    for index in range(2):
        numpy.save(tmp_path / f"tokens-{index}.npy", numpy.arange(index * 10, index * 10 + 10).reshape(5, 2))
        numpy.save(tmp_path / f"labels-{index}.npy", numpy.arange(5) + index * 5)
    source = DataSource(str(tmp_path / "{field}-*.npy"), inputs="tokens", target="labels", batch_size=4,
                        shuffle=False)
    x, y = source.epoch(0)[1].read()
    assert x.tolist() == [[8, 9], [10, 11], [12, 13], [14, 15]] and y.tolist() == [4, 5, 6, 7]
    assert x.dtype == torch.int64
    with pytest.raises(InvalidArgument, match="put '{field}' in the url"):
        DataSource(str(tmp_path / "tokens-*.npy"), batch_size=4)
    numpy.save(tmp_path / "bad.npy", numpy.asfortranarray(numpy.ones((3, 2))))
    with pytest.raises(DataLoss, match="C order"):
        data_files.inspect(*data_files.filesystem(str(tmp_path / "bad.npy")), "npy")


def test_files_that_disagree_or_lie_are_refused(parts, tmp_path):
    write_safetensors(parts / "part-3.safetensors", {"x": torch.zeros(2, 4), "y": torch.zeros(2, 1).long()})
    with pytest.raises(InvalidArgument, match="holds torch.float32 rows of \\[4\\]"):
        DataSource(str(parts), batch_size=4)
    (parts / "part-3.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(DataLoss, match="part-3.safetensors' is not a whole safetensors file .*header too large"):
        DataSource(str(parts), batch_size=4)
    os.remove(parts / "part-3.safetensors")
    with pytest.raises(InvalidArgument, match="has no tensor 'z'"):
        DataSource(str(parts), inputs="z", batch_size=4)
    with pytest.raises(InvalidArgument, match="no safetensors files at"):
        DataSource(str(tmp_path / "nothing-*.safetensors"), batch_size=4)
    with pytest.raises(InvalidArgument, match="has rows 0..4; asked for \\[5\\]"):
        data_files.read(rows_message(parts / "part-0.safetensors", "x", [1, 5]), data_files.HeaderCache())
    with pytest.raises(NotFound):
        data_files.read(rows_message(parts / "gone.safetensors", "x", [0]), data_files.HeaderCache())


def test_a_shard_reads_only_under_its_data_roots(parts, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    write_safetensors(outside / "secret.safetensors", {"x": torch.ones(2, 3)})
    os.symlink(outside / "secret.safetensors", parts / "link.safetensors")
    reader = data_files.Reader([str(parts), "s3://bucket/train"])
    assert reader.read(rows_message(f"file://{parts}/part-0.safetensors", "x", [0])).shape == (1, 3)
    for url in (outside / "secret.safetensors", parts / "link.safetensors", f"{parts}/../outside/x.safetensors",
                "s3://bucket/training/x.safetensors", "s3://bucket/train/../other/x.safetensors",
                "s3://other/train/x.safetensors", "memory://bucket/train/x.safetensors"):
        with pytest.raises(PermissionDenied, match="outside this shard's data roots"):
            reader.read(rows_message(url, "x", [0]))
    with pytest.raises(FailedPrecondition, match="--data-root"):
        data_files.Reader([]).read(rows_message(parts / "part-0.safetensors", "x", [0]))
    with pytest.raises(InvalidArgument, match="chained"):
        reader.read(rows_message(f"simplecache::file://{parts}/part-0.safetensors", "x", [0]))


def test_data_roots_come_from_flags_and_the_environment():
    settings = shard_settings(["--coordinator", "c:1", "--data-root", "/data", "--data-root", "s3://b/p/"],
                              env={"SHARDTRAIN_DATA_ROOTS": "/env,s3://e/"})
    assert settings.data_roots == ("/env", "s3://e/", "/data", "s3://b/p/")
    with pytest.raises(SystemExit):
        shard_settings(["--coordinator", "c:1", "--data-root", "s3://b/../x/"], env={})
