"""A torchvision-style ResNet (BatchNorm, ReLU(inplace=True) on block inputs) trains as one process in the loop, and
under train_step's micro-batches its running statistics advance once a step, from the whole batch, with one
warning."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn


class Block(nn.Module):
    """A basic residual block as torchvision writes it: in-place ReLUs, the identity added in place."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.blocks = nn.ModuleList([Block(8) for _ in range(3)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(steps: int = 4, rows: int = 8):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 3, 8, 8, generator=generator), torch.randint(0, 5, (rows,), generator=generator))
            for _ in range(steps)]


def statistics(state: dict) -> dict:
    return {key: value for key, value in state.items() if "running" in key or "num_batches" in key}


def test_a_resnet_with_in_place_relu_and_batch_norm_trains_in_the_loop_as_one_process(cluster4):
    torch.manual_seed(0)
    local, data = ResNet(), batches()
    remote = cluster4.deploy(copy.deepcopy(local), optimizer=(torch.optim.SGD, {"lr": 0.05}), example_input=data[0][0])
    optimizer = torch.optim.SGD(local.parameters(), lr=0.05)
    for x, y in data:
        nn.functional.cross_entropy(remote(x), y).backward()
        remote.step()
        remote.zero_grad()
        nn.functional.cross_entropy(local(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    state, expected = remote.state_dict(), local.state_dict()
    assert max((state[key].double() - expected[key].double()).abs().max().item() for key in expected) < 1e-5


def test_micro_batches_advance_running_statistics_as_the_whole_batch_and_warn_once(cluster4):
    torch.manual_seed(0)
    local, data = ResNet(), batches()
    remote = cluster4.deploy(copy.deepcopy(local), optimizer=(torch.optim.SGD, {"lr": 0.0}), example_input=data[0][0])
    with pytest.warns(UserWarning, match="each micro-batch is normalised with its own statistics"):
        remote.train_step(*data[0], nn.CrossEntropyLoss(), microbatches=4)
    with torch.no_grad():
        local(data[0][0])  # lr 0: the weights stay, only the statistics move, from the whole batch
    for x, y in data[1:]:
        remote.train_step(x, y, nn.CrossEntropyLoss(), microbatches=4)
        with torch.no_grad():
            local(x)
    state, expected = statistics(remote.state_dict()), statistics(local.state_dict())
    assert {key: int(value) for key, value in state.items() if "num_batches" in key} == \
        {key: len(data) for key in expected if "num_batches" in key}  # once a step, not once a micro-batch
    # The first batch norm sees the same inputs either way: its statistics are the whole batch's. Later ones see
    # inputs the earlier ones normalised per micro-batch, as torchgpipe's deferred batch norm does too.
    first = [key for key in expected if key.startswith("stem.1.running")]
    assert max((state[key] - expected[key]).abs().max().item() for key in first) < 1e-5
