"""shardtrain.checkpoint: safetensors files that the safetensors library reads and writes alike."""

from __future__ import annotations

import pytest
import torch

from shardtrain import checkpoint
from shardtrain.errors import DataLoss

TENSORS = {"w": torch.randn(3, 5), "half": torch.randn(4).to(torch.bfloat16), "steps": torch.tensor(7.0),
           "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "mask": torch.tensor([True, False]),
           "empty": torch.zeros(0, 4)}


def same(left: dict, right: dict) -> bool:
    return list(left) == list(right) and all(left[k].dtype == right[k].dtype and torch.equal(left[k], right[k])
                                             for k in left)


def test_files_round_trip_and_the_safetensors_library_reads_them_and_writes_what_this_reads(tmp_path):
    library = pytest.importorskip("safetensors.torch")
    checkpoint.write_safetensors(tmp_path / "ours.safetensors", TENSORS)
    assert same(checkpoint.read_safetensors(tmp_path / "ours.safetensors"), TENSORS)
    theirs = library.load_file(str(tmp_path / "ours.safetensors"))
    assert same({k: theirs[k] for k in TENSORS}, TENSORS)
    library.save_file(TENSORS, str(tmp_path / "theirs.safetensors"))
    read = checkpoint.read_safetensors(tmp_path / "theirs.safetensors")
    assert same({k: read[k] for k in TENSORS}, TENSORS)


@pytest.mark.parametrize("damage", ["truncated", "header too long", "header not json", "header not an object",
                                    "offsets past the end"])
def test_a_damaged_file_is_data_loss(tmp_path, damage):
    path = tmp_path / "t.safetensors"
    checkpoint.write_safetensors(path, {"w": torch.ones(4)})
    raw = path.read_bytes()
    raw = {"truncated": raw[:-1], "header too long": (1 << 40).to_bytes(8, "little") + raw[8:],
           "header not json": raw[:8] + b"x" + raw[9:],
           "header not an object": (8).to_bytes(8, "little") + b"[1]     " + raw[-16:],
           "offsets past the end": raw.replace(b"[0,16]", b"[0,99]")}[damage]
    path.write_bytes(raw)
    with pytest.raises(DataLoss, match="checkpoint"):
        checkpoint.read_safetensors(path)
