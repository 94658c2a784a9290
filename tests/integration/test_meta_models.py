"""Models built on the meta device deploy without the client ever holding their weights: captured from shapes,
initialised a module at a time as building them on the CPU would have, and trained as one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardtrain.errors import InvalidArgument
from tests.integration.training import largest_difference, regression_batches, train_locally, train_remotely


class Blocks(nn.Module):
    """A whole model with a ModuleList of blocks, normalisation with running statistics and attention, whose
    constructor initialises a child (its out_proj) before resetting its own tensors."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        h = h + self.attention(h[:, None], h[:, None], h[:, None], need_weights=False)[0][:, 0]
        return self.head(self.norm(h))


def built(cls, device: str, seed: int = 0):
    torch.manual_seed(seed)
    with torch.device(device):
        return cls()


@pytest.mark.parametrize("cls", [lambda: nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                                                       nn.Linear(32, 1)), Blocks], ids=["Sequential", "whole model"])
def test_a_model_built_on_meta_deploys_initialised_as_on_the_cpu_and_trains_as_one_process(cluster4, cls):
    # SGD: Adam scales the rounding in attention's query and key biases (whose gradient is zero: softmax over one
    # key) up to full steps, in one process as on shards
    local, example, sgd = built(cls, "cpu"), torch.randn(4, 3), (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
    empty = built(cls, "meta")  # seeded as `local` was: the deploy draws what its constructors drew
    assert all(p.is_meta for p in empty.parameters())
    model = cluster4.deploy(empty, optimizer=sgd, example_input=example, num_stages=3)
    assert all(p.is_meta for p in empty.parameters())  # the model given stays empty
    assert largest_difference(model.state_dict(), local.state_dict()) == 0.0  # the same draws, in the same order
    batches = regression_batches(steps=4, batch=8, features=3)
    train_remotely(model, batches)
    assert largest_difference(model.state_dict(), train_locally(copy.deepcopy(local), batches, sgd)) < 1e-5


class Raw(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.randn(3))  # drawn in __init__: nothing can draw it again

    def forward(self, x):
        return self.linear(x) * self.scale


def test_a_meta_model_with_a_tensor_no_module_can_initialise_is_refused_naming_it(cluster4):
    with pytest.raises(InvalidArgument, match=r"the model \(Raw\) holds \['scale'\] on the meta device and has no "
                                              r"reset_parameters"):
        cluster4.deploy(built(Raw, "meta"), example_input=torch.randn(4, 3))

