"""shardtrain.checkpoint: safetensors files that the safetensors library reads and writes alike, their modes, and
saves published whole or refused."""

from __future__ import annotations

import errno
import os
import re
import stat

import pytest
import torch

from shardtrain import checkpoint, optim
from shardtrain import checkpoint_store as store
from shardtrain.errors import DataLoss, NotFound, PermissionDenied, ResourceExhausted, Unavailable

TENSORS = {"w": torch.randn(3, 5), "half": torch.randn(4).to(torch.bfloat16), "steps": torch.tensor(7.0),
           "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "mask": torch.tensor([True, False]),
           "empty": torch.zeros(0, 4)}


def same(left: dict, right: dict) -> bool:
    """The same tensors under the same names (a file holds them in the library's order, larger dtypes first)."""
    return sorted(left) == sorted(right) and all(left[k].dtype == right[k].dtype and torch.equal(left[k], right[k])
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


WEIGHTS = {"w": torch.ones(3, 2)}
STATE = optim.KeyedState([{"params": ["w"], "lr": 0.1}], {"w/momentum_buffer": torch.zeros(3, 2)}, {})


@pytest.fixture
def umask():
    """Sets the process's umask for a test, and puts the old one back."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


def test_files_and_directories_get_their_modes_whatever_the_umask(tmp_path, umask):
    umask(0o277)  # would leave the owner unable to write, and others as they are
    checkpoint.save(tmp_path / "made" / "here", WEIGHTS, STATE, ["w"])
    (generation,) = (tmp_path / "made" / "here").glob("generation-*")
    assert {mode(path) for path in [*generation.iterdir(), tmp_path / "made" / "here" / "checkpoint.json"]} == {0o600}
    assert {mode(path) for path in (tmp_path / "made", tmp_path / "made" / "here", generation)} == {0o700}
    assert checkpoint.load(tmp_path / "made" / "here")[0]["w"].equal(WEIGHTS["w"])


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to a group of which this user is not a member needs root")
def test_a_configured_group_may_read_and_only_it(tmp_path, umask):
    umask(0o077)  # would take the group's bits away
    access = store.Access(group=65534)
    generation = store.new_generation()
    checkpoint.write_part(tmp_path, generation, 0, 1, WEIGHTS, STATE, 4, access)
    checkpoint.publish(tmp_path, generation, checkpoint.description(1, WEIGHTS, ["w"], generation=generation,
                                                                    step=4), access)
    folder = store.generation_directory(tmp_path, generation)
    files = [*folder.iterdir(), tmp_path / "checkpoint.json"]
    assert {(mode(path), path.stat().st_gid) for path in files} == {(0o640, 65534)}
    assert (mode(folder), folder.stat().st_gid) == (0o750, 65534)


def test_a_publish_refuses_a_missing_part_or_a_part_of_another_step_naming_the_stage(tmp_path):
    generation = store.new_generation()
    checkpoint.write_part(tmp_path, generation, 0, 2, WEIGHTS, STATE, 6)
    text = checkpoint.description(2, WEIGHTS, ["w"], generation=generation, step=6)
    with pytest.raises(NotFound, match="model-00001-of-00002.safetensors is missing"):
        checkpoint.publish(tmp_path, generation, text)
    checkpoint.write_part(tmp_path, generation, 1, 2, WEIGHTS, STATE, 3)
    with pytest.raises(DataLoss, match=r"stage 1's part \(model-00001-of-00002.safetensors\) holds optimizer step 3, "
                                       "the checkpoint step 6"):
        checkpoint.publish(tmp_path, generation, text)
    assert not (tmp_path / "checkpoint.json").exists()
    with pytest.raises(NotFound, match="a save into it began but did not finish"):
        checkpoint.load(tmp_path)


@pytest.mark.parametrize("number, status", [(errno.ENOSPC, ResourceExhausted), (errno.EDQUOT, ResourceExhausted),
                                            (errno.EACCES, PermissionDenied), (errno.EIO, Unavailable)])
def test_storage_errors_become_statuses_naming_the_path_and_the_room_left(tmp_path, number, status):
    error = store.storage_error(OSError(number, os.strerror(number)), tmp_path / "not-yet" / "file")
    assert isinstance(error, status)  # a status the SDK maps back, not the raw OSError
    assert re.search(rf"writing {tmp_path}/not-yet/file failed: {os.strerror(number)} \(\d+ bytes free there\)",
                     str(error))


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)
