"""Checkpoints the shards write and read themselves: every stage writes its own part at once, under the directory
the shard was started with, and any split (or the SDK, from the files) loads the result exactly."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import subprocess
import tempfile
import threading
import time

import pytest
import torch
from torch import nn

from client_sdk import Cluster, LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL
from shardtrain import checkpoint, checkpoint_store, errors
from shardtrain.v1 import shard_pb2
from tests.integration.test_errors import kill_shard
from tests.integration.training import largest_difference, regression_batches, train_copy, train_remotely

ADAM = (torch.optim.Adam, {"lr": 3e-3})


def generations(directory) -> list:
    """The generation directories of a checkpoint directory: one per save that was published or did not finish."""
    return sorted(directory.glob(checkpoint_store.PREFIX + "*"))


def seed_net() -> LayerList:
    torch.manual_seed(0)
    return LayerList(TEST_RESIDUAL_SMALL)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """(the shards' --checkpoint-dir, a directory outside it). The first is one any user may enter, as a shared
    filesystem's often is: only the checkpoints' own modes keep others out."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="shards-write-here-"))
    root.chmod(0o755)
    yield root, tmp_path_factory.mktemp("elsewhere")
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def writing_cluster(roots):
    with Cluster.local(num_shards=4, checkpoint_dir=roots[0]) as cluster:
        yield cluster


def test_every_stage_writes_its_part_and_another_split_resumes_exactly(writing_cluster, roots):
    root, _ = roots
    net, batches = seed_net(), regression_batches(steps=8, batch=32, features=1)
    model = writing_cluster.deploy(net, optimizer=ADAM, num_stages=3)
    train_remotely(model, batches[:4])
    model.save_checkpoint(root / "step-4")
    parts = [f"{kind}-{p:05d}-of-00003.safetensors" for p in range(3) for kind in ("model", "optimizer")]
    (saved,) = generations(root / "step-4")
    assert sorted(os.listdir(root / "step-4")) == ["checkpoint.json", saved.name]
    assert sorted(os.listdir(saved)) == sorted(parts)  # one part per stage
    weights, optimizer_state = checkpoint.load(root / "step-4")  # the SDK reads the shards' parts as its own
    assert list(weights) == list(model.state_dict()) and largest_difference(weights, model.state_dict()) == 0.0
    assert optimizer_state["param_groups"] == model.optimizer_state_dict()["param_groups"]

    resumed = writing_cluster.deploy(seed_net(), optimizer=(torch.optim.Adam, {"lr": 1.0}), num_stages=2)
    resumed.load_checkpoint(root / "step-4")  # each of two stages reads its tensors from three parts
    assert resumed.optimizer.param_groups[0]["lr"] == 3e-3  # the checkpoint's, here and on the shards
    train_remotely(resumed, batches[4:])
    expected, _ = train_copy(net, batches, ADAM)
    assert largest_difference(resumed.state_dict(), expected.state_dict()) <= 1e-6

    through_sdk = writing_cluster.deploy(seed_net(), optimizer=ADAM, num_stages=4)
    through_sdk.load_checkpoint(root / "step-4", on_shards=False)
    assert largest_difference(through_sdk.state_dict(), weights) == 0.0


def test_a_changed_learning_rate_and_replicas_come_back_from_a_checkpoint(writing_cluster, roots):
    root, _ = roots
    model = writing_cluster.deploy(seed_net(), optimizer=ADAM, num_stages=2, replicas=2)
    for x, y in regression_batches(steps=2, batch=32, features=1):
        model.train_step(x, y, "MSELoss")
    model.optimizer.param_groups[0]["lr"] = 5e-4  # not yet sent to the shards: the checkpoint holds it all the same
    model.save_checkpoint("replicated", on_shards=True)  # relative to the shards' directory
    assert sorted(os.listdir(root / "replicated"))[0] == "checkpoint.json"
    saved = model.state_dict()
    other = writing_cluster.deploy(seed_net(), optimizer=ADAM, num_stages=2, replicas=2)
    other.load_checkpoint(root / "replicated")
    assert other.optimizer.param_groups[0]["lr"] == 5e-4
    assert largest_difference(other.state_dict(), saved) == 0.0
    for replica in other._trainer.replicas:  # every replica loaded, not only the one read back
        state = other._io.run(replica.read_state())
        assert largest_difference({k: state[k] for k in saved}, saved) == 0.0


def test_checkpoints_outside_the_shards_directory_are_refused_and_the_sdk_writes_them_itself(writing_cluster, roots):
    root, elsewhere = roots
    model = writing_cluster.deploy(seed_net(), optimizer=ADAM, num_stages=2)
    first = model._clients.stages[0]
    with pytest.raises(errors.FailedPrecondition, match=r"writes and reads checkpoints only under its --checkpoint"):
        model.save_checkpoint(elsewhere / "insisted", on_shards=True)
    model.save_checkpoint(elsewhere / "gathered")  # outside: this process writes it, in one part
    (gathered,) = generations(elsewhere / "gathered")
    assert sorted(os.listdir(elsewhere / "gathered")) == ["checkpoint.json", gathered.name]
    assert sorted(os.listdir(gathered)) == ["model-00000-of-00001.safetensors", "optimizer-00000-of-00001.safetensors"]
    os.symlink(elsewhere, root / "link-out")
    generation = checkpoint_store.new_generation()
    for directory in ("../escape", str(elsewhere / "raw"), "link-out/inside-a-link"):
        with pytest.raises(errors.PermissionDenied, match="is outside this shard's --checkpoint-dir"):
            model._io.run(first.call("SaveCheckpoint", shard_pb2.SaveCheckpointRequest(
                deployment_id=model.deployment_id, directory=directory, part=0, parts=2, generation=generation)))
    with pytest.raises(errors.InvalidArgument, match="checkpoint part 2 of 2"):
        model._io.run(first.call("SaveCheckpoint", shard_pb2.SaveCheckpointRequest(
            deployment_id=model.deployment_id, directory="bad-part", part=2, parts=2, generation=generation)))
    with pytest.raises(errors.InvalidArgument, match="checkpoint generation '../x' must look like"):
        model._io.run(first.call("SaveCheckpoint", shard_pb2.SaveCheckpointRequest(
            deployment_id=model.deployment_id, directory="bad-generation", part=0, parts=2, generation="../x")))
    with pytest.raises(errors.InvalidArgument, match="is not a shardtrain-checkpoint-3 checkpoint"):
        model._io.run(first.call("SaveCheckpoint", shard_pb2.SaveCheckpointRequest(
            deployment_id=model.deployment_id, directory="bad-description", description='{"format": "pickle"}',
            generation=generation)))
    assert not any((root / name).exists() for name in ("bad-part", "bad-generation", "bad-description"))
    assert not (elsewhere / "raw").exists() and not (elsewhere / "inside-a-link").exists()
    x, y = regression_batches(steps=1, batch=8, features=1)[0]
    assert model.train_step(x, y, "MSELoss") > 0  # the shard serves on


def test_a_checkpoint_that_does_not_fit_changes_no_stage(writing_cluster, roots):
    root, _ = roots
    model = writing_cluster.deploy(seed_net(), optimizer=ADAM, num_stages=2)
    train_remotely(model, regression_batches(steps=1, batch=32, features=1))
    model.save_checkpoint(root / "good")
    before = model.state_dict()
    with pytest.raises(errors.NotFound, match="holds no checkpoint.json"):
        model.load_checkpoint(root / "nowhere")
    (saved,) = generations(root / "good")
    last = saved / "model-00001-of-00002.safetensors"
    tensors, metadata = checkpoint.read_part(last)
    dropped = sorted(tensors)[0]
    checkpoint.write_safetensors(last, {k: v for k, v in tensors.items() if k != dropped}, metadata)
    train_remotely(model, regression_batches(steps=1, batch=32, features=1, seed=1))
    trained = model.state_dict()
    assert largest_difference(trained, before) > 0
    with pytest.raises(errors.InvalidArgument, match=f"holds no weight '{dropped}' of stage 1"):
        model.load_checkpoint(root / "good")  # stage 0 would load; it waits for stage 1's check, which fails
    assert largest_difference(model.state_dict(), trained) == 0.0


def test_a_shard_without_a_checkpoint_directory_writes_nothing(cluster4, tmp_path):
    model = cluster4.deploy(seed_net(), optimizer=ADAM, num_stages=2)
    with pytest.raises(errors.FailedPrecondition, match="none: it was started without one"):
        model.save_checkpoint(tmp_path / "x", on_shards=True)
    with pytest.raises(errors.FailedPrecondition, match="start it with --checkpoint-dir"):
        model._io.run(model._clients.stages[0].call("SaveCheckpoint", shard_pb2.SaveCheckpointRequest(
            deployment_id=model.deployment_id, directory=str(tmp_path / "x"), part=0, parts=2)))
    assert not (tmp_path / "x").exists()


def big_net() -> nn.Sequential:
    """Stage 1 of layers_per_stage=[2, 3] holds 16 MiB of weights (and 32 MiB of Adam state): its part takes long
    enough to write that a shard can be killed in the middle of it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 1))


def kill_when_writing(cluster: Cluster, address: str, directory: pathlib.Path, published: pathlib.Path,
                      part: int) -> None:
    """SIGKILLs the shard at `address` as soon as a file of part `part` shows in a generation of `directory` other
    than `published` (within a minute)."""
    prefix = f"model-{part:05d}-"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(name.startswith(prefix) for folder in generations(directory) if folder != published
               for name in os.listdir(folder)):
            kill_shard(cluster, address)
            return
        time.sleep(0.0005)  # a poll: the write it waits for takes tens of milliseconds
    raise AssertionError(f"no file of part {part} showed in {directory} within a minute")


def test_a_shard_killed_while_saving_over_a_checkpoint_leaves_the_directory_refused_never_mixed(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    batches = regression_batches(steps=6, batch=16, features=8)
    with Cluster.local(num_shards=3, checkpoint_dir=root) as cluster:
        logs = cluster._services.log_dir  # kept by close() because a shard died: removed below, on purpose
        model = cluster.deploy(big_net(), optimizer=ADAM, layers_per_stage=[2, 3])
        train_remotely(model, batches[:3])
        model.save_checkpoint(root / "latest")
        at_three = model.state_dict(), model.optimizer_state_dict()
        (published,) = generations(root / "latest")
        train_remotely(model, batches[3:])
        victim = model.placements[1].shard_address
        watcher = threading.Thread(target=kill_when_writing, args=(cluster, victim, root / "latest", published, 1))
        watcher.start()
        with pytest.raises(errors.ShardtrainError, match=victim):
            model.save_checkpoint(root / "latest")  # saving step 6 over step 3
        watcher.join()
        (cut,) = [folder for folder in generations(root / "latest") if folder != published]
        assert not (cut / "optimizer-00001-of-00002.safetensors").exists(), "the kill came after stage 1's part"
        assert not (cut / "model-00000-of-00002.safetensors").exists()  # stage 0's was written, then discarded
        refused = rf"a save into it did not finish.*stage 1 cut off while being written.*Remove {cut}"
        with pytest.raises(errors.FailedPrecondition, match=refused):
            checkpoint.load(root / "latest")
        fresh = cluster.deploy(big_net(), optimizer=ADAM, layers_per_stage=[2, 3])  # the two shards left
        with pytest.raises(errors.FailedPrecondition, match=refused):
            fresh._io.run(fresh._clients.stages[1].call("LoadCheckpoint", shard_pb2.LoadCheckpointRequest(
                deployment_id=fresh.deployment_id, directory=str(root / "latest"), check_only=True)))
        with pytest.raises(errors.FailedPrecondition, match=refused):
            fresh.load_checkpoint(root / "latest")
        shutil.rmtree(cut)  # as the message says: the checkpoint the save was to replace loads, whole
        fresh.load_checkpoint(root / "latest")
        assert largest_difference(fresh.state_dict(), at_three[0]) == 0.0
        steps = {float(entry["step"]) for entry in fresh.optimizer_state_dict()["state"].values()}
        assert steps == {3.0} == {float(entry["step"]) for entry in at_three[1]["state"].values()}
    shutil.rmtree(logs, ignore_errors=True)


def test_parts_of_different_saves_or_steps_are_refused_naming_the_stage(writing_cluster, roots):
    root, _ = roots
    model = writing_cluster.deploy(seed_net(), optimizer=ADAM, num_stages=2)
    batches = regression_batches(steps=2, batch=32, features=1)
    train_remotely(model, batches[:1])
    model.save_checkpoint(root / "step-1")
    train_remotely(model, batches[1:])
    model.save_checkpoint(root / "step-2")
    trained = model.state_dict()
    (older,), (newer,) = generations(root / "step-1"), generations(root / "step-2")
    stage_one = [f"{kind}-00001-of-00002.safetensors" for kind in ("model", "optimizer")]
    for name in stage_one:  # the torn checkpoint an interrupted save in place used to leave
        shutil.copy(older / name, newer / name)
    mixed = r"stage 1's part \(model-00001-of-00002.safetensors\) belongs to save .*its parts come from different"
    with pytest.raises(errors.DataLoss, match=mixed):
        model.load_checkpoint(root / "step-2")  # every shard reads every part's header
    with pytest.raises(errors.DataLoss, match=mixed):
        checkpoint.load(root / "step-2")
    for name in stage_one:  # the same save's name, another step's
        tensors, metadata = checkpoint.read_part(older / name)
        checkpoint.write_safetensors(newer / name, tensors, {**metadata, "generation": newer.name.split("-", 1)[1]})
    with pytest.raises(errors.DataLoss, match=r"stage 1's part \(model-00001-of-00002.safetensors\) holds optimizer "
                                              r"step 1, the checkpoint step 2: its parts do not all belong to the "
                                              "same step"):
        model.load_checkpoint(root / "step-2")
    assert largest_difference(model.state_dict(), trained) == 0.0


def test_shard_written_checkpoints_are_their_owners_alone(writing_cluster, roots):
    root, _ = roots
    model = writing_cluster.deploy(seed_net(), optimizer=ADAM, num_stages=2)
    train_remotely(model, regression_batches(steps=1, batch=8, features=1))
    model.save_checkpoint(root / "private" / "step-1")
    (saved,) = generations(root / "private" / "step-1")
    files = [root / "private" / "step-1" / "checkpoint.json", *saved.iterdir()]
    assert {stat.S_IMODE(path.stat().st_mode) for path in files} == {0o600}
    directories = (root / "private", root / "private" / "step-1", saved)
    assert {stat.S_IMODE(path.stat().st_mode) for path in directories} == {0o700}
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("trying the files as another local user needs root and setpriv (util-linux)")
    for path in directories:
        path.chmod(0o755)  # even with every directory opened up, the files stay closed
    control = saved / "anyone-may-read"
    control.write_bytes(b"x")
    control.chmod(0o644)
    for path in files:
        refused = read_as_nobody(path)
        assert refused.returncode != 0 and "Permission denied" in refused.stderr, (path, refused)
    assert read_as_nobody(control).stdout == "x"  # the user reaches the directory: only the modes keep it out


def read_as_nobody(path: pathlib.Path) -> subprocess.CompletedProcess:
    """Reads a byte of `path` as user and group nobody (65534), in a process of its own (setpriv changes user
    after the fork: this process has gRPC's threads, and a fork that changes user itself is not safe here)."""
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "head", "-c", "1",
                           str(path)], capture_output=True, text=True, timeout=60)


@pytest.fixture
def small_disk(roots):
    """A 2 MiB tmpfs mounted under the shards' --checkpoint-dir (root only), unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    mount = roots[0] / "small-disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mount)],
                          capture_output=True, text=True, timeout=60)
    if made.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True, timeout=60)
    mount.rmdir()


def test_a_full_disk_is_resource_exhausted_naming_the_path_and_leaves_no_partial_files(writing_cluster, small_disk):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1))  # stage 0's part: 4 MiB of weights
    model = writing_cluster.deploy(net, optimizer=(torch.optim.SGD, {"lr": 0.01}), layers_per_stage=[2, 1])
    full = r"/generation-\S+/model-00000-of-0000[12].safetensors failed: No space left on device " \
        r"\(\d+ bytes free there\)"
    with pytest.raises(errors.ResourceExhausted, match=f"writing {small_disk}/on-shards{full}"):
        model.save_checkpoint(small_disk / "on-shards")
    with pytest.raises(errors.ResourceExhausted, match=f"writing {small_disk}/here{full}") as raised:
        model.save_checkpoint(small_disk / "here", on_shards=False)  # this process writes it
    assert not isinstance(raised.value, OSError)
    assert [path for path in small_disk.rglob("*") if path.is_file()] == []  # every part of both saves removed
    usage = os.statvfs(small_disk)
    assert usage.f_bavail * usage.f_frsize >= (2 << 20) - (64 << 10)  # the room is free again
    for directory in ("on-shards", "here"):
        with pytest.raises(errors.NotFound, match="a save into it began but did not finish"):
            checkpoint.load(small_disk / directory)
    x, y = regression_batches(steps=1, batch=8, features=1024)[0]
    assert model.train_step(x, y, "MSELoss") > 0  # the shards serve on


def test_a_checkpoint_of_the_layout_before_generations_still_loads_and_a_save_replaces_it(writing_cluster, roots):
    """The previous layout: parts beside checkpoint.json, format shardtrain-checkpoint-2, no save or step in the
    files' metadata. Made here from a save of today's layout by moving its files as that code wrote them."""
    root, _ = roots
    model = writing_cluster.deploy(seed_net(), optimizer=ADAM, num_stages=2)
    train_remotely(model, regression_batches(steps=2, batch=32, features=1))
    model.save_checkpoint(root / "earlier")
    saved_state = model.state_dict()
    (saved,) = generations(root / "earlier")
    for path in saved.iterdir():
        tensors, metadata = checkpoint.read_part(path)
        checkpoint.write_safetensors(root / "earlier" / path.name, tensors,
                                     {"layout": metadata["layout"]} if "layout" in metadata else None)
    shutil.rmtree(saved)
    described = json.loads((root / "earlier" / "checkpoint.json").read_text())
    described = {k: v for k, v in described.items() if k not in ("generation", "step")}
    (root / "earlier" / "checkpoint.json").write_text(json.dumps({**described, "format": "shardtrain-checkpoint-2"}))
    fresh = writing_cluster.deploy(seed_net(), optimizer=ADAM, num_stages=3)
    fresh.load_checkpoint(root / "earlier")  # by the shards
    assert largest_difference(fresh.state_dict(), saved_state) == 0.0
    assert largest_difference(checkpoint.load(root / "earlier")[0], saved_state) == 0.0  # by the SDK
    fresh.save_checkpoint(root / "earlier")  # replaces it: the parts of the earlier layout go
    (replaced,) = generations(root / "earlier")
    assert sorted(os.listdir(root / "earlier")) == ["checkpoint.json", replaced.name]
    assert json.loads((root / "earlier" / "checkpoint.json").read_text())["format"] == checkpoint.FORMAT
