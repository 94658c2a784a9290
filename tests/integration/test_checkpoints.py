"""Checkpoints the shards write and read themselves: every stage writes its own part at once, under the directory
the shard was started with, and any split (or the SDK, from the files) loads the result exactly."""

from __future__ import annotations

import os

import pytest
import torch

from client_sdk import Cluster, LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL
from shardtrain import checkpoint, errors
from shardtrain.v1 import shard_pb2
from tests.integration.training import largest_difference, regression_batches, train_copy, train_remotely

ADAM = (torch.optim.Adam, {"lr": 3e-3})


def seed_net() -> LayerList:
    torch.manual_seed(0)
    return LayerList(TEST_RESIDUAL_SMALL)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """(the shards' --checkpoint-dir, a directory outside it)."""
    return tmp_path_factory.mktemp("shards-write-here"), tmp_path_factory.mktemp("elsewhere")


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
    assert sorted(os.listdir(root / "step-4")) == sorted(["checkpoint.json", *parts])  # one part per stage
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
    assert sorted(os.listdir(elsewhere / "gathered")) == [
        "checkpoint.json", "model-00000-of-00001.safetensors", "optimizer-00000-of-00001.safetensors"]
    os.symlink(elsewhere, root / "link-out")
    for directory in ("../escape", str(elsewhere / "raw"), "link-out/inside-a-link"):
        with pytest.raises(errors.PermissionDenied, match="is outside this shard's --checkpoint-dir"):
            model._io.run(first.call("SaveCheckpoint", shard_pb2.SaveCheckpointRequest(
                deployment_id=model.deployment_id, directory=directory, part=0, parts=2)))
    with pytest.raises(errors.InvalidArgument, match="checkpoint part 2 of 2"):
        model._io.run(first.call("SaveCheckpoint", shard_pb2.SaveCheckpointRequest(
            deployment_id=model.deployment_id, directory="bad-part", part=2, parts=2)))
    with pytest.raises(errors.InvalidArgument, match="is not a shardtrain-checkpoint-2 checkpoint"):
        model._io.run(first.call("SaveCheckpoint", shard_pb2.SaveCheckpointRequest(
            deployment_id=model.deployment_id, directory="bad-description", description='{"format": "pickle"}')))
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
    last = root / "good" / "model-00001-of-00002.safetensors"
    tensors = checkpoint.read_safetensors(last)
    dropped = sorted(tensors)[0]
    checkpoint.write_safetensors(last, {k: v for k, v in tensors.items() if k != dropped})
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
