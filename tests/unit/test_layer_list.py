"""client_sdk.layer_list: the seed's layer-list format as a local module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from client_sdk.layer_list import LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL, wrapped_linear
from shardtrain.errors import InvalidArgument
from shardtrain.residuals import Wiring


@pytest.fixture
def seed() -> LayerList:
    torch.manual_seed(0)
    return LayerList(TEST_RESIDUAL_SMALL)


def test_state_dict_keys_are_index_dot_name_like_a_sequential(seed):
    assert list(seed.state_dict()) == [
        "0.weight", "0.bias", "2.linear.weight", "2.linear.bias", "4.weight", "4.bias",
        "6.linear.weight", "6.linear.bias", "8.weight", "8.bias"]


def test_children_are_the_seed_layers_in_order(seed):
    assert [type(layer) for layer in seed.children()] == [
        nn.Linear, nn.ReLU, wrapped_linear, nn.ReLU, nn.Linear, nn.ReLU, wrapped_linear, nn.ReLU, nn.Linear, nn.Sigmoid]


def test_wirings_come_from_the_kwargs(seed):
    plain = Wiring()
    assert seed.wirings == [plain, plain, Wiring(out_variables=("res_1",)), plain, plain, plain,
                            Wiring(dependencies=("res_1",)), plain, plain, plain]


def test_wiring_keys_reach_constructors_that_take_them(seed):
    layers = dict(seed.named_children())
    assert (layers["2"].dependencies, layers["2"].out_variables) == ([], ["res_1"])
    assert (layers["6"].dependencies, layers["6"].out_variables) == (["res_1"], [])


class TakesAnything(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, x, *dependencies):
        return x, x


def test_wiring_keys_do_not_reach_constructors_that_do_not_take_them():
    spec = [(TakesAnything, {"out_variables": ["a"], "size": 3}, (2, 4)),
            (nn.Linear, {"in_features": 4, "out_features": 4, "dependencies": ["a"]}, (2, 4))]
    layers = LayerList(spec)  # nn.Linear(dependencies=...) would raise TypeError
    children = dict(layers.named_children())
    assert children["0"].kwargs == {"out_variables": ["a"], "size": 3}
    assert isinstance(children["1"], nn.Linear)
    assert layers.wirings == [Wiring(out_variables=("a",)), Wiring(dependencies=("a",))]


def test_forward_runs_the_seed_chain(seed):
    layers = dict(seed.named_children())
    x = torch.randn(5, 1)
    h = torch.relu(layers["0"](x))
    h = torch.relu(layers["2"].linear(h))                    # saves res_1 = its output
    h = torch.relu(layers["4"](h))
    h = torch.relu(layers["6"].linear(h))                    # the seed discards res_1 here (see seed_models)
    expected = torch.sigmoid(layers["8"](h))
    assert torch.allclose(seed(x), expected)


def test_forward_adds_the_residual_when_the_consumer_uses_it():
    torch.manual_seed(0)
    spec = [(wrapped_linear, {"in_features": 2, "out_features": 2, "out_variables": ["res_1"]}, [(4, 2)]),
            (wrapped_linear, {"in_features": 2, "out_features": 2, "dependencies": ["res_1"],
                              "out_variables": ["out"]}, [(4, 2), (4, 2)])]
    layers = LayerList(spec)
    first, second = layers.children()
    x = torch.randn(4, 2)
    res_1 = first.linear(x)
    assert torch.allclose(layers(x), second.linear(res_1) + res_1)


def test_example_input_has_the_declared_row_shape(seed):
    assert seed.example_input(3).shape == (3, 1)


def test_example_input_from_a_list_of_shapes():
    spec = [(wrapped_linear, {"in_features": 6, "out_features": 2, "out_variables": ["r"]}, [(32, 6)])]
    assert LayerList(spec).example_input(2).shape == (2, 6)


def test_input_shapes_are_kept(seed):
    assert seed.input_shapes[0] == (32, 1) and seed.input_shapes[6] == [(32, 512), (32, 512)]


@pytest.mark.parametrize("entry", [(nn.ReLU, {}), (nn.ReLU,), (nn.ReLU, {}, (2, 2), "extra")])
def test_entry_that_is_not_a_triple_is_refused_by_index(entry):
    spec = [(nn.ReLU, {}, (2, 2)), entry]
    with pytest.raises(InvalidArgument, match=r"layer 1: expected \(layer_class, kwargs, input_shape\)"):
        LayerList(spec)


def test_kwargs_the_class_refuses_are_named():
    with pytest.raises(InvalidArgument, match=r"layer 0: Linear\(\*\*\{'in_feature': 2, 'out_features': 2\}\) failed"):
        LayerList([(nn.Linear, {"in_feature": 2, "out_features": 2}, (2, 2))])


def test_wiring_errors_are_refused():
    spec = [(wrapped_linear, {"in_features": 2, "out_features": 2, "dependencies": ["res_9"]}, [(2, 2), (2, 2)])]
    with pytest.raises(InvalidArgument, match="layer 0 depends on 'res_9'"):
        LayerList(spec)
