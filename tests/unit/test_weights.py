"""Where a stage's tensors lie in a safetensors file, a directory or a sharded checkpoint's index, read from the
headers alone; a source that names files outside its directory or the data roots is refused."""

from __future__ import annotations

import json

import pytest
import torch

from shardtrain import weights
from shardtrain.checkpoint import write_safetensors
from shardtrain.errors import DataLoss, InvalidArgument, NotFound, PermissionDenied


@pytest.fixture
def sharded(tmp_path):
    """A checkpoint in two files and an index, as save_pretrained(max_shard_size=...) writes it."""
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a.weight": torch.arange(6.).reshape(2, 3)})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors",
                      {"b.weight": torch.ones(4), "b.bias": torch.zeros(4)})
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "b.weight": "model-00002-of-00002.safetensors",
                                            "b.bias": "model-00002-of-00002.safetensors"}}
    (tmp_path / weights.INDEX).write_text(json.dumps(index))
    return tmp_path


def test_an_index_sends_each_key_to_its_file_and_only_those_files_are_opened(sharded):
    (sharded / "model-00002-of-00002.safetensors").write_bytes(b"not read: no key of the stage is in it")
    located = weights.locate(str(sharded), {"a.weight": ("a.weight",)}, [str(sharded)])
    assert list(located) == ["a.weight"] and located["a.weight"].shape == (2, 3)
    tensors = weights.read(located)
    assert torch.equal(tensors["a.weight"], torch.arange(6.).reshape(2, 3))


def test_a_tied_key_is_found_under_its_first_name(sharded):
    located = weights.locate(str(sharded / weights.INDEX), {"head.weight": ("head.weight", "b.weight")},
                             [str(sharded)])
    assert torch.equal(weights.read(located)["head.weight"], torch.ones(4))


def test_a_directory_without_an_index_reads_every_safetensors_file_header(tmp_path):
    write_safetensors(tmp_path / "one.safetensors", {"x": torch.ones(2)})
    write_safetensors(tmp_path / "two.safetensors", {"y": torch.zeros(3)})
    located = weights.locate(str(tmp_path), {"x": ("x",), "y": ("y",), "z": ("z",)}, [str(tmp_path)])
    assert sorted(located) == ["x", "y"]  # the caller names what is missing
    write_safetensors(tmp_path / "three.safetensors", {"x": torch.ones(2)})
    with pytest.raises(DataLoss, match="tensor 'x' is in both"):
        weights.locate(str(tmp_path), {"x": ("x",)}, [str(tmp_path)])


def test_a_dtype_or_shape_that_is_not_the_stages_is_refused_naming_both(sharded):
    located = weights.locate(str(sharded), {"b.weight": ("b.weight",)}, [str(sharded)])
    with pytest.raises(InvalidArgument, match=r"'b.weight' is a torch.float32 of shape \[4\].*stage holds a "
                                              r"torch.bfloat16 of shape \[2, 2\]"):
        weights.check(located, {"b.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}, str(sharded))


def test_an_index_naming_a_file_outside_its_directory_is_refused(sharded):
    (sharded / weights.INDEX).write_text(json.dumps({"weight_map": {"a.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(DataLoss, match="names file '../elsewhere.safetensors'"):
        weights.locate(str(sharded), {"a.weight": ("a.weight",)}, [str(sharded)])
    (sharded / weights.INDEX).write_text("{not json")
    with pytest.raises(DataLoss, match="is not JSON"):
        weights.locate(str(sharded), {"a.weight": ("a.weight",)}, [str(sharded)])


def test_sources_outside_the_roots_and_missing_ones_are_refused(sharded, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    with pytest.raises(PermissionDenied, match="outside this shard's data roots"):
        weights.locate(str(sharded), {"a.weight": ("a.weight",)}, [str(other)])
    with pytest.raises(NotFound, match="no such file or directory"):
        weights.locate(str(other / "absent"), {"a.weight": ("a.weight",)}, [str(other)])


def test_batches_keep_to_the_limit_but_for_one_larger_tensor(sharded):
    located = weights.locate(str(sharded), {k: (k,) for k in ("a.weight", "b.weight", "b.bias")}, [str(sharded)])
    assert [sorted(batch) for batch in weights.batches(located, limit=32)] == [["a.weight"], ["b.bias", "b.weight"]]
    assert len(list(weights.batches(located, limit=1))) == 3


def test_a_plan_names_the_first_missing_tensor_and_its_tied_names(sharded):
    expected = {"a.weight": torch.zeros(2, 3), "head.weight": torch.zeros(4)}
    with pytest.raises(InvalidArgument, match=r"hold no tensor 'head.weight' \(nor its tied \['lm.weight'\]\) of "
                                              r"stage 3: 1 of its 2 missing"):
        weights.plan(str(sharded), {"a.weight": ("a.weight",), "head.weight": ("head.weight", "lm.weight")},
                     expected, [str(sharded)], "stage 3")
    located = weights.plan(str(sharded), {"a.weight": ("a.weight",)}, expected, [str(sharded)], "stage 3")
    assert list(located) == ["a.weight"]
