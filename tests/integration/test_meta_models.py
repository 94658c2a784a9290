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


def test_a_transformers_model_on_meta_is_initialised_as_its_library_builds_it(cluster4):
    """LlamaForCausalLM's constructors draw torch's initialisation, then its post_init draws the library's, inner
    model first: the shards get the weights `torch.manual_seed(s); LlamaForCausalLM(config)` has."""
    transformers = pytest.importorskip("transformers")
    from tests.integration.test_library_models import deploy, largest_difference as differs_most, llama, \
        text_batches
    torch.manual_seed(7)
    expected, _ = llama()
    torch.manual_seed(7)
    with torch.device("meta"):
        empty = transformers.LlamaForCausalLM(expected.config)
    remote = deploy(cluster4, empty, text_batches(1))
    assert len(remote.placements) == 4
    difference, key = differs_most(remote.state_dict(), expected.state_dict())
    assert difference == 0, key
