"""The optimizer as PyTorch users set it up: an instance with param groups (weight decay on matrices only, as
nanoGPT's configure_optimizers), an lr scheduler bound to model.optimizer, global gradient-norm clipping, each
across three stages and equal to the same training in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardtrain.errors import InvalidArgument
from tests.integration.training import largest_difference, regression_batches

STEPS = 12


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def configure_optimizers(module: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's recipe: AdamW, weight decay on 2-D weights only."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-2, betas=(0.9, 0.95))


def train_here(module: nn.Module, batches, clip: float | None):
    optimizer = configure_optimizers(module)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    norms = []
    for x, y in batches:
        torch.nn.functional.mse_loss(module(x), y).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(module.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return optimizer, norms


def train_both(model, local: nn.Module, optimizer: torch.optim.Optimizer, batches) -> None:
    """The plain loop, step for step on the deployed model and on `local` with `optimizer`."""
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.step()
        model.zero_grad()
        torch.nn.functional.mse_loss(local(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("clip", [None, 0.05])
def test_param_groups_a_cosine_schedule_and_clipping_train_as_one_process(cluster4, clip):
    local, batches = net(), regression_batches(steps=STEPS, batch=16, features=3)
    remote_net = copy.deepcopy(local)
    model = cluster4.deploy(remote_net, optimizer=configure_optimizers(remote_net), num_stages=3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(model.optimizer, T_max=STEPS)
    norms = []
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            norms.append(model.clip_grad_norm_(clip).item())
        model.optimizer.step()
        model.optimizer.zero_grad()
        schedule.step()
    local_optimizer, local_norms = train_here(local, batches, clip)
    assert largest_difference(model.state_dict(), local.state_dict()) <= 1e-5
    assert norms == pytest.approx(local_norms, rel=1e-5)
    if clip is not None:
        assert min(local_norms) > clip  # the clipping did scale every step
    state, expected = model.optimizer_state_dict(), local_optimizer.state_dict()
    assert [g["lr"] for g in state["param_groups"]] == pytest.approx([g["lr"] for g in expected["param_groups"]])
    assert [g["weight_decay"] for g in state["param_groups"]] == [0.1, 0.0]
    assert [g["params"] for g in state["param_groups"]] == [g["params"] for g in expected["param_groups"]]


def test_a_schedule_reaches_train_step_too(cluster4):
    local, batches = net(), regression_batches(steps=6, batch=16, features=3)
    model = cluster4.deploy(copy.deepcopy(local), optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                            num_stages=3)
    schedule = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=2, gamma=0.5)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
    local_schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for x, y in batches:
        model.train_step(x, y, "MSELoss", microbatches=4, schedule="1f1b")
        schedule.step()
        torch.nn.functional.mse_loss(local(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        local_schedule.step()
    assert largest_difference(model.state_dict(), local.state_dict()) <= 1e-5


def test_groups_given_by_name_and_filter_and_the_refusals(cluster4):
    local, batches = net(), regression_batches(steps=3, batch=16, features=3)
    groups = [{"params": lambda key, p: p.dim() >= 2, "lr": 0.05}, {"params": ["0.bias", "2.bias", "4.bias"]}]
    model = cluster4.deploy(copy.deepcopy(local), optimizer=(torch.optim.SGD, groups, {"lr": 0.1}), num_stages=2)
    optimizer = torch.optim.SGD([{"params": [p for p in local.parameters() if p.dim() >= 2], "lr": 0.05},
                                 {"params": [p for p in local.parameters() if p.dim() < 2]}], lr=0.1)
    train_both(model, local, optimizer, batches)
    assert largest_difference(model.state_dict(), local.state_dict()) <= 1e-5
    with pytest.raises(InvalidArgument, match=r"parameter '0.bias' is in param groups 0 and 1"):
        cluster4.deploy(net(), optimizer=(torch.optim.SGD, [{"params": ["0.bias"]}, {"params": ["0.bias"]}], {}))
    with pytest.raises(InvalidArgument, match=r"param group 0 names 9.weight that is not a parameter of the model"):
        cluster4.deploy(net(), optimizer=(torch.optim.SGD, [{"params": ["9.weight"]}], {"lr": 0.1}))
    with pytest.raises(InvalidArgument, match=r"optimizer takes \(class, kwargs\)"):
        cluster4.deploy(net(), optimizer=(torch.optim.SGD, 0.1))


@pytest.mark.parametrize("num_stages, replicas", [(3, 1), (2, 2)])
def test_train_step_clips_by_the_global_norm_as_one_process(cluster4, num_stages, replicas):
    local, batches = net(), regression_batches(steps=6, batch=16, features=3)
    remote_net = copy.deepcopy(local)
    model = cluster4.deploy(remote_net, optimizer=configure_optimizers(remote_net), num_stages=num_stages,
                            replicas=replicas)
    optimizer = configure_optimizers(local)
    for x, y in batches:
        model.train_step(x, y, "MSELoss", microbatches=2, schedule="1f1b", clip_grad_norm=0.05)
        torch.nn.functional.mse_loss(local(x), y).backward()
        local_norm = torch.nn.utils.clip_grad_norm_(local.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
        assert model.grad_norm().item() == pytest.approx(local_norm.item(), rel=1e-5)
    assert local_norm > 0.05
    assert largest_difference(model.state_dict(), local.state_dict()) <= 1e-5


def test_frozen_parameters_take_no_gradient_and_the_model_lists_its_parameters(cluster4):
    local, batches = net(), regression_batches(steps=4, batch=16, features=3)
    for parameter in local[0].parameters():
        parameter.requires_grad_(False)  # fine-tuning: the first layer stays as it is
    remote = copy.deepcopy(local)
    model = cluster4.deploy(remote, optimizer=torch.optim.Adam(remote.parameters(), lr=0.01), num_stages=3)
    named = dict(model.named_parameters())
    assert list(named) == [name for name, _ in local.named_parameters()]
    assert named["0.weight"].shape == (16, 3) and named["0.weight"].dim() == 2 and not named["0.weight"].requires_grad
    assert named["4.bias"].requires_grad and named["4.bias"].stages == (2,)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in local.parameters())
    optimizer = torch.optim.Adam(local.parameters(), lr=0.01)
    train_both(model, local, optimizer, batches)
    trained = model.state_dict()
    assert torch.equal(trained["0.weight"], net().state_dict()["0.weight"])
    assert largest_difference(trained, local.state_dict()) <= 1e-5
