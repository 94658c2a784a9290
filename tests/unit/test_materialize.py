"""client_sdk/materialize.py: a meta model initialised module by module, each layer pushed as soon as it is ready."""

from __future__ import annotations

import torch
from torch import nn

from client_sdk import materialize


def test_each_layer_is_pushed_once_as_soon_as_it_is_ready_with_the_values_of_a_cpu_build():
    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    torch.manual_seed(0)
    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    layers = [{"0.weight", "0.bias"}, {"1.weight", "1.bias"}, {"2.weight", "2.bias"}]
    pushed = []
    materialize.initialise_in_parts(empty, layers, pushed.append)
    assert [set(part) for part in pushed] == layers
    assert all(torch.equal(part[key], local.state_dict()[key]) for part in pushed for key in part)
    assert all(p.is_meta for p in empty.parameters())


def test_a_weight_two_layers_hold_waits_for_both_and_is_pushed_to_each():
    with torch.device("meta"):
        empty = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    empty[1].weight = empty[0].weight  # tied, as a language model's head
    pushed = []
    materialize.initialise_in_parts(empty, [{"0.weight"}, {"1.weight"}], pushed.append)
    assert [list(part) for part in pushed] == [["0.weight"], ["1.weight"]]
    assert torch.equal(pushed[0]["0.weight"], pushed[1]["1.weight"])  # one tensor, its first owner's values
