"""client_sdk/materialize.py: a meta model initialised module by module, each layer pushed as soon as it is ready."""

from __future__ import annotations

import pytest
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


def test_a_transformers_model_is_initialised_as_its_library_builds_it_one_module_at_a_time():
    """LlamaForCausalLM's constructors draw torch's initialisation; then its inner model's post_init draws the
    library's before the outer one makes its head: the parts equal `torch.manual_seed(s); LlamaForCausalLM(c)`."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(7)
    expected = transformers.LlamaForCausalLM(config).state_dict()
    after_build = torch.get_rng_state()
    torch.manual_seed(7)
    with torch.device("meta"):
        empty = transformers.LlamaForCausalLM(config)
    pushed = {}
    materialize.initialise_in_parts(empty, [{key} for key in empty.state_dict()], pushed.update)
    assert list(pushed) == list(expected)
    assert all(torch.equal(pushed[key], expected[key]) for key in expected)
    assert torch.equal(torch.get_rng_state(), after_build)  # the stream where a CPU build leaves it
