"""Optimizer state on shards: it reads back as one process's optimizer.state_dict(), and a checkpoint of weights
plus optimizer state resumes training exactly, on a fresh deployment or from one process's training."""

from __future__ import annotations

import copy

import pytest
import torch

from client_sdk import LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL
from shardtrain.errors import InvalidArgument
from tests.integration.training import largest_difference, regression_batches, train_copy, train_remotely

ADAM = (torch.optim.Adam, {"lr": 3e-3})


def local_training(net: torch.nn.Module, batches, optimizer=ADAM):
    """(a copy of `net` trained on `batches` in this process, its optimizer)."""
    return train_copy(net, batches, optimizer)


def largest_state_difference(state: dict, expected: dict) -> float:
    """Largest difference between two optimizer state_dicts, which must agree in every other respect."""
    assert state["param_groups"] == expected["param_groups"]
    assert {i: sorted(entries) for i, entries in state["state"].items()} == \
        {i: sorted(entries) for i, entries in expected["state"].items()}
    return max((state["state"][i][name] - value).abs().max().item()
               for i, entries in expected["state"].items() for name, value in entries.items())


def seed_net() -> LayerList:
    torch.manual_seed(0)
    return LayerList(TEST_RESIDUAL_SMALL)


def test_optimizer_state_reads_back_as_one_process_optimizers(cluster4):
    net, batches = seed_net(), regression_batches(steps=6, batch=32, features=1)
    model = cluster4.deploy(net, optimizer=ADAM, num_stages=3)
    train_remotely(model, batches)
    _, opt = local_training(net, batches)
    assert largest_state_difference(model.optimizer_state_dict(), opt.state_dict()) <= 1e-5


def test_a_checkpoint_resumes_training_exactly_on_a_fresh_deployment(cluster4, tmp_path):
    net, batches = seed_net(), regression_batches(steps=10, batch=32, features=1)
    model = cluster4.deploy(net, optimizer=ADAM, num_stages=3)
    train_remotely(model, batches[:5])
    torch.save({"model": model.state_dict(), "optimizer": model.optimizer_state_dict()}, tmp_path / "checkpoint.pt")

    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    resumed = cluster4.deploy(seed_net(), optimizer=ADAM, num_stages=2)  # another split: state goes by name
    resumed.load_state_dict(checkpoint["model"])
    resumed.load_optimizer_state_dict(checkpoint["optimizer"])
    train_remotely(resumed, batches[5:])
    local, opt = local_training(net, batches)
    assert largest_difference(resumed.state_dict(), local.state_dict()) <= 1e-5
    assert largest_state_difference(resumed.optimizer_state_dict(), opt.state_dict()) <= 1e-5


def test_training_started_in_one_process_goes_on_on_shards(cluster4):
    net, batches = seed_net(), regression_batches(steps=8, batch=32, features=1)
    started, opt = local_training(net, batches[:4])
    model = cluster4.deploy(started, optimizer=ADAM, num_stages=3)
    model.load_optimizer_state_dict(opt.state_dict())
    train_remotely(model, batches[4:])
    local, _ = local_training(net, batches)
    assert largest_difference(model.state_dict(), local.state_dict()) <= 1e-5


def test_a_state_that_does_not_fit_is_refused_and_training_goes_on_unchanged(cluster4):
    net, batches = seed_net(), regression_batches(steps=6, batch=32, features=1)
    model = cluster4.deploy(net, optimizer=ADAM, num_stages=3)
    train_remotely(model, batches[:3])
    before = model.optimizer_state_dict()

    wrong_shape = copy.deepcopy(before)
    wrong_shape["state"][0]["exp_avg"] = torch.zeros(3)  # stage 0 refuses; the last stage would take its share
    wrong_shape["state"][9]["exp_avg"] = wrong_shape["state"][9]["exp_avg"] * 2
    with pytest.raises(InvalidArgument, match=r"stage 0\).*optimizer state 0.weight/exp_avg has shape \[3\]; "
                                              r"expected \[512, 1\]"):
        model.load_optimizer_state_dict(wrong_shape)
    _, sgd = local_training(net, batches[:1], (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
    with pytest.raises(InvalidArgument, match=r"has \['momentum_buffer'\]; Adam keeps \['exp_avg', 'exp_avg_sq', "
                                              r"'step'\]"):
        model.load_optimizer_state_dict(sgd.state_dict())
    with pytest.raises(InvalidArgument, match="over this model's 10 parameters"):
        model.load_optimizer_state_dict(torch.optim.Adam(torch.nn.Linear(2, 2).parameters()).state_dict() | {
            "param_groups": [{"params": [0, 1, 99]}]})

    assert largest_state_difference(model.optimizer_state_dict(), before) == 0
    train_remotely(model, batches[3:])
    local, _ = local_training(net, batches)
    assert largest_difference(model.state_dict(), local.state_dict()) <= 1e-5


def test_a_durable_checkpoint_resumes_training_exactly_on_another_split_and_holds_no_pickle(cluster4, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    net, batches = seed_net(), regression_batches(steps=8, batch=32, features=1)
    model = cluster4.deploy(net, optimizer=ADAM, num_stages=3)
    train_remotely(model, batches[:4])
    model.save_checkpoint(tmp_path / "step-4")
    (saved,) = (tmp_path / "step-4").glob("generation-*")  # the save's own directory, named by checkpoint.json
    assert sorted(p.name for p in (tmp_path / "step-4").iterdir()) == ["checkpoint.json", saved.name]
    assert sorted(p.name for p in saved.iterdir()) == [
        "model-00000-of-00001.safetensors", "optimizer-00000-of-00001.safetensors"]
    stored = safetensors_torch.load_file(str(saved / "model-00000-of-00001.safetensors"))  # others read it
    weights = model.state_dict()  # the file holds them in the library's order: by dtype, then name
    assert largest_difference({key: stored[key] for key in weights if key in stored}, weights) == 0.0
    resumed = cluster4.deploy(seed_net(), optimizer=ADAM, num_stages=2)  # another split, fresh weights
    resumed.load_checkpoint(tmp_path / "step-4")
    train_remotely(resumed, batches[4:])
    expected, optimizer = local_training(net, batches)
    assert largest_difference(resumed.state_dict(), expected.state_dict()) <= 1e-6
    assert largest_state_difference(resumed.optimizer_state_dict(), optimizer.state_dict()) <= 1e-6


def test_a_checkpoint_that_is_missing_or_damaged_is_refused_and_the_model_keeps_its_weights(cluster4, tmp_path):
    from shardtrain.errors import DataLoss, NotFound
    model = cluster4.deploy(seed_net(), optimizer=ADAM, num_stages=2)
    before = model.state_dict()
    with pytest.raises(NotFound, match="holds no checkpoint.json"):
        model.load_checkpoint(tmp_path / "nowhere")
    model.save_checkpoint(tmp_path / "good")
    (saved,) = (tmp_path / "good").glob("generation-*")
    damaged = saved / "model-00000-of-00001.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-4])  # the last tensor lost its last bytes
    with pytest.raises(DataLoss, match="model-00000-of-00001.safetensors is not a whole safetensors file"):
        model.load_checkpoint(tmp_path / "good")
    assert largest_difference(model.state_dict(), before) == 0.0
