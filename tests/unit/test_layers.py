"""client_sdk.layers: what a user deploys, as layers with wiring, state-dict prefixes and captured programs."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from client_sdk import layers as layer_tools
from client_sdk.layer_list import LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL, wrapped_linear
from shardtrain import wire
from shardtrain.capture import CapturedProgram
from shardtrain.errors import InvalidArgument
from shardtrain.residuals import Wiring


def test_a_seed_layer_list_becomes_a_layer_list():
    assert isinstance(layer_tools.as_module(TEST_RESIDUAL_SMALL), LayerList)


def test_a_module_is_used_as_it_is():
    model = nn.Sequential(nn.Linear(2, 2))
    assert layer_tools.as_module(model) is model


def test_anything_else_cannot_be_deployed():
    with pytest.raises(InvalidArgument, match="cannot deploy a dict"):
        layer_tools.as_module({"0": nn.Linear(2, 2)})


def test_layers_of_a_sequential_are_plain_with_index_prefixes():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    assert [(layer.module, layer.wiring, layer.prefix) for layer in layer_tools.layers_of(model)] == [
        (model[0], Wiring(), "0"), (model[1], Wiring(), "1")]


def test_layers_of_a_layer_list_carry_its_wiring():
    layers = layer_tools.layers_of(LayerList(TEST_RESIDUAL_SMALL))
    assert [layer.prefix for layer in layers] == [str(i) for i in range(10)]
    assert layers[2].wiring == Wiring(out_variables=("res_1",))
    assert layers[6].wiring == Wiring(dependencies=("res_1",))


def test_other_modules_are_captured_whole():
    assert layer_tools.is_layered(nn.Sequential()) and layer_tools.is_layered(LayerList(TEST_RESIDUAL_SMALL))
    assert not layer_tools.is_layered(nn.Linear(2, 2))
    layers, _ = layer_tools.whole_model_layers(nn.Linear(2, 2), (torch.randn(3, 2),), {})
    assert [layer.name for layer in layers] == ["(model)"]  # no submodules: one part


def test_cost_is_the_parameter_count():
    costs = [layer.cost for layer in layer_tools.layers_of(LayerList(TEST_RESIDUAL_SMALL))]
    assert costs == [1024, 0, 262656, 0, 262656, 0, 262656, 0, 513, 0]


def test_example_input_from_a_first_linear():
    model = nn.Sequential(nn.Linear(5, 2))
    assert layer_tools.example_input(model, layer_tools.layers_of(model)).shape == (2, 5)


def test_example_input_from_the_seed_shapes():
    model = LayerList(TEST_RESIDUAL_SMALL)
    assert layer_tools.example_input(model, layer_tools.layers_of(model)).shape == (2, 1)


def test_example_input_cannot_be_guessed_for_other_first_layers():
    model = nn.Sequential(nn.Conv1d(1, 1, 3))
    with pytest.raises(InvalidArgument, match="cannot guess the input of a model starting with Conv1d"):
        layer_tools.example_input(model, layer_tools.layers_of(model))


def test_capture_describes_each_layer_with_its_wiring_and_model_keys():
    torch.manual_seed(0)
    spec = [(wrapped_linear, {"in_features": 3, "out_features": 3, "out_variables": ["res_1"]}, [(4, 3)]),
            (wrapped_linear, {"in_features": 3, "out_features": 3, "dependencies": ["res_1"]}, [(4, 3), (4, 3)])]
    model = LayerList(spec)
    captured = layer_tools.capture(layer_tools.layers_of(model), torch.randn(8, 3))
    assert [(c.index, list(c.dependencies), list(c.out_variables), c.cost) for c in captured] == [
        (0, [], ["res_1"], 12), (1, ["res_1"], [], 12)]
    assert [[(e.graph_key, e.model_key) for e in c.state] for c in captured] == [
        [("layer.linear.weight", "0.linear.weight"), ("layer.linear.bias", "0.linear.bias")],
        [("layer.linear.weight", "1.linear.weight"), ("layer.linear.bias", "1.linear.bias")]]
    assert "\n" not in captured[0].description and captured[0].description.startswith("wrapped_linear(")
    # The second layer was captured with the residual as its dependency input.
    assert len(CapturedProgram(captured[1].program).input_specs()) == 2


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


def test_layer_that_cannot_be_captured_is_named_with_the_line_and_what_to_do():
    layers = layer_tools.layers_of(nn.Sequential(nn.Identity(), DataDependent()))
    with pytest.raises(InvalidArgument) as refused:
        layer_tools.capture(layers, torch.randn(2, 3))
    message = str(refused.value)
    assert message.startswith("layer 1 (DataDependent) cannot be captured with torch.export in training mode at ")
    line = inspect.getsourcelines(DataDependent.forward)[1] + 1
    assert f"test_layers.py:{line} (`if x.sum() > 0:`): its forward takes a path that depends on the values" in message
    assert "torch.where" in message and len(message) < 500 and "torch/" not in message


class TrainingNoise(nn.Module):
    """A custom layer that reads its own mode: adds 1 in training mode only."""

    def forward(self, x):
        return x + 1 if self.training else x


class CountsCalls(nn.Module):
    """A layer that assigns a new tensor to its buffer on every call, rather than updating it in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls = self.calls + 1
        return x


def test_an_eval_mode_graph_is_captured_for_the_layers_that_read_their_mode_only():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Dropout(0.2), TrainingNoise())
    captured = layer_tools.capture(layer_tools.layers_of(model), torch.randn(4, 3))
    assert [bool(c.eval_program) for c in captured] == [False, True, False, True, True]
    noise = CapturedProgram(captured[4].eval_program).load({})
    assert torch.equal(noise(torch.zeros(2, 3)), torch.zeros(2, 3))


def test_capture_model_leaves_buffers_modes_and_the_random_stream_as_they_were():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Dropout(0.5), CountsCalls())
    model[1].eval()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    calls = model[3].calls
    random_state = torch.get_rng_state()
    captured = layer_tools.capture_model(model, layer_tools.layers_of(model))
    assert len(captured) == 4
    assert torch.equal(torch.get_rng_state(), random_state)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert model[3].calls is calls
    assert [m.training for m in model.modules()] == [True, True, False, True, True]


def test_example_inputs_give_each_layers_input_shapes_and_leave_the_model_alone():
    model = nn.Sequential(nn.Linear(4, 64), nn.BatchNorm1d(64), nn.Dropout(0.5), nn.Linear(64, 4))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    layers = layer_tools.layers_of(model)
    captured, x = layer_tools.capture_model(model, layers), torch.randn(8, 4)
    state = torch.random.get_rng_state()
    layer_tools.describe_inputs(model, layers, captured, x)
    assert [[list(spec.shape) for spec in layer.example_inputs] for layer in captured] == [[[8, 4]], [[8, 64]],
                                                                                            [[8, 64]], [[8, 64]]]
    assert {spec.dtype for layer in captured for spec in layer.example_inputs} == {wire.dtype_code(torch.float32)}
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), state)


def test_weight_bytes_count_gradients_and_optimizer_state_of_what_trains():
    layer = layer_tools.layers_of(nn.Sequential(nn.BatchNorm1d(4)))[0]
    # weight and bias (4 floats each) with a gradient and 2 Adam moments; running mean, var (4 floats) and count once
    assert layer_tools.weight_bytes(layer, 2) == 2 * 16 * 4 + 16 + 16 + 8


class Uninitialised(nn.Module):
    """Adds memory nobody wrote: refused, on the client, at the line that calls it."""

    def forward(self, x):
        return x + torch.empty_like(x)


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 3), Uninitialised()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_refused_operator_is_named_with_its_module_and_source_line_before_anything_is_shipped():
    model = Blocks()
    layers, _ = layer_tools.whole_model_layers(model, (torch.randn(4, 3),), {})
    line = inspect.getsourcelines(Uninitialised.forward)[1] + 1
    with pytest.raises(InvalidArgument, match=rf"layer 1 \(blocks.1 \(Uninitialised\)\): captured program calls "
                                              rf"'torch.ops.aten.empty_like.default', which returns uninitialized "
                                              rf".*; in blocks.1 at .*test_layers.py:{line} "
                                              rf"\(`return x \+ torch.empty_like\(x\)`\)"):
        layer_tools.capture_model(model, layers, torch.randn(4, 3))
