"""Models whose blocks branch with torch.cond, compute a statistic under torch.no_grad() and a product under
torch.autocast: captured with the higher-order operators export writes for them, run on the shards as written, and
trained equal to one process, in the PyTorch loop and in pipelined schedules whose backward is split in two."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.integration.training import largest_difference, regression_batches

WIDTH = 8
MSE = torch.nn.functional.mse_loss


class Gated(nn.Module):
    """One of two computations, chosen by a tensor: the sign of the batch's mean."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.cond(x.mean() > 0, lambda v: torch.tanh(self.linear(v)), lambda v: self.linear(v) * 0.5, (x,))


class Scaled(nn.Module):
    """Divides by each row's norm computed without autograd: no gradient flows through the scale."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        with torch.no_grad():
            scale = x.norm(dim=-1, keepdim=True) + 1
        return self.linear(x) / scale


class Mixed(nn.Module):
    """A residual block whose product runs in bfloat16 under autocast."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.linear(x)
        return x + y.float()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Gated(), Scaled(), Mixed(), Gated()])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def net_and_batches(steps: int):
    torch.manual_seed(0)
    batches = regression_batches(steps=steps, batch=8, features=WIDTH, seed=3)
    assert {bool(x.mean() > 0) for x, _ in batches} == {True, False}  # the first block takes both branches
    return Net(), batches


def test_a_model_with_cond_no_grad_and_autocast_trains_in_the_loop_as_one_process(cluster4):
    local, batches = net_and_batches(steps=6)
    model = cluster4.deploy(copy.deepcopy(local), optimizer=(torch.optim.Adam, {"lr": 0.01}),
                            example_input=batches[0][0], num_stages=3)
    optimizer = torch.optim.Adam(local.parameters(), lr=0.01)
    for x, y in batches:
        remote_loss = MSE(model(x), y)
        remote_loss.backward()
        model.step()
        model.zero_grad()
        local_loss = MSE(local(x), y)
        local_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert remote_loss.item() == pytest.approx(local_loss.item(), rel=1e-5)
    assert largest_difference(model.state_dict(), local.state_dict()) < 1e-5


@pytest.mark.parametrize("pipeline_schedule, recompute", [("zb-h1", "never"), ("1f1b", "always")])
def test_a_model_with_cond_no_grad_and_autocast_trains_with_train_step_as_one_process(cluster4, pipeline_schedule,
                                                                                      recompute):
    local, batches = net_and_batches(steps=4)
    model = cluster4.deploy(copy.deepcopy(local), optimizer=(torch.optim.SGD, {"lr": 0.1}),
                            example_input=batches[0][0], num_stages=3, recompute=recompute)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
    for x, y in batches:
        model.train_step(x, y, loss_fn=MSE, microbatches=2, schedule=pipeline_schedule)
        for part, target in zip(x.chunk(2), y.chunk(2)):  # each micro-batch takes its own branch, as on the shards
            (MSE(local(part), target) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert largest_difference(model.state_dict(), local.state_dict()) < 1e-5
