"""client_sdk.whole_model_cuts: the whole graph cut between submodules, each part running as the model's own slice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from client_sdk import whole_model_cuts
from client_sdk.layers import capture_model, whole_model_layers
from shardtrain.capture import LayerAdapter
from shardtrain.errors import InvalidArgument
from shardtrain.residuals import run_chain


class Tokens(nn.Module):
    """Token ids and a mask made first and read last; a size read in the first part and used in the last."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = tokens != 0
        x = self.embed(tokens)
        for layer in self.body:
            x = layer(x)
        x = self.head(x) * mask.unsqueeze(-1)
        return x.reshape(tokens.shape[0], -1)


def run_parts(layers, x: torch.Tensor) -> torch.Tensor:
    adapters = [LayerAdapter(layer.module, layer.wiring.out_variables) for layer in layers]
    return run_chain(adapters, [layer.wiring for layer in layers], x, {})


def test_unit_names_look_through_containers_at_any_depth():
    assert whole_model_cuts.unit_names(Tokens()) == ["embed", "body.0.0", "body.0.1", "body.1.0", "body.1.1", "head"]


def test_values_a_later_part_reads_travel_by_name_with_their_dtypes():
    torch.manual_seed(0)
    model = Tokens()
    tokens = torch.tensor([[1, 0, 3], [4, 5, 0]])
    layers, _ = whole_model_layers(model, (tokens,), {}, {"tokens": {1: torch.export.Dim("seq", max=8)}})
    assert [layer.name for layer in layers] == whole_model_cuts.unit_names(model)
    # the first part saves the ids' mask for the head; the head reads it after the main input
    assert layers[0].wiring.out_variables == ("ne",)
    assert layers[-1].wiring.dependencies == ("ne",)
    assert layers[0].varying == ((0, 1),)
    for x in (tokens, torch.tensor([[2, 0, 1, 1, 7]])):  # other batch sizes and lengths
        assert torch.equal(run_parts(layers, x), model(x))


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(self.embed(idx))


def test_a_tied_weight_keeps_each_parts_own_name():
    layers, _ = whole_model_layers(TiedHead(), (torch.tensor([[1, 2], [3, 4]]),), {})
    keys = [[dict(layer.keys)[key] for key, _ in layer.module.named_parameters()] for layer in layers]
    assert keys == [["embed.weight"], ["head.weight"]]


class Blocks(nn.Module):
    """Two identical blocks and a head that reads the first block's weight too."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        x = self.blocks[1](self.blocks[0](x))
        return self.head(x) + self.blocks[0].weight.sum()


def test_a_units_own_weights_are_named_by_their_path_inside_it_and_others_by_their_model_key():
    layers, _ = whole_model_layers(Blocks(), (torch.randn(2, 3),), {})
    assert [dict(layer.keys) for layer in layers] == [
        {"weight": "blocks.0.weight", "bias": "blocks.0.bias"}, {"weight": "blocks.1.weight", "bias": "blocks.1.bias"},
        {"weight": "head.weight", "bias": "head.bias", "blocks.0.weight": "blocks.0.weight"}]
    captured = capture_model(Blocks(), layers, torch.randn(2, 3))
    assert captured[0].program == captured[1].program  # identical blocks: captured once, the same program
    assert [[(e.graph_key, e.model_key) for e in layer.state] for layer in captured[:2]] == [
        [("layer.weight", "blocks.0.weight"), ("layer.bias", "blocks.0.bias")],
        [("layer.weight", "blocks.1.weight"), ("layer.bias", "blocks.1.bias")]]


class NotPersistent(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(2), persistent=False)

    def forward(self, x):
        return x * self.scale


class Constant(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.ones(2)

    def forward(self, x):
        return x * self.scale


class Counter(nn.Module):
    """Counts rows in a buffer outside its submodules: the count would be changed on one stage, read on another."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(2, 2), nn.Linear(2, 2)
        self.register_buffer("rows", torch.zeros(()))

    def forward(self, x):
        self.rows = self.rows + x.shape[0]
        return self.second(self.first(x))


class Scored(nn.Module):
    """Two inputs (one a keyword) and a dict of outputs, one of them a constant, one the target passed on."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x, target=None, weight=None, scale=1.0):
        y = self.second(self.first(x))
        return {"y": y, "loss": ((y - target) ** 2).mean(), "rows": 3, "target": target}


def test_a_tensor_the_forward_reads_that_is_no_buffer_travels_as_a_constant_of_its_layer():
    layers, _ = whole_model_layers(Constant(), (torch.randn(3, 2),), {})
    (key, value), = [pair for layer in layers for pair in layer.constants]
    assert key == "scale" and torch.equal(value, torch.ones(2))


@pytest.mark.parametrize("model, expected", [
    (Counter(), "changes buffer 'rows' in 'second' and reads it in 'first'; a buffer must be changed and read within "
                "one submodule"),
])
def test_state_the_shards_could_not_receive_is_refused(model, expected):
    with pytest.raises(InvalidArgument, match=expected):
        whole_model_layers(model, (torch.randn(3, 2),), {})


def test_a_non_persistent_buffer_is_a_weight_of_its_part():
    layers, _ = whole_model_layers(NotPersistent(), (torch.randn(3, 2),), {})
    assert [dict(layer.module.named_buffers()).keys() for layer in layers] == [{"scale"}]


def test_several_inputs_and_outputs_travel_by_name():
    torch.manual_seed(0)
    model = Scored()
    x, target = torch.randn(3, 2), torch.randn(3, 2)
    layers, interface = whole_model_layers(model, (x,), {"target": target})
    assert interface.inputs == ("x", "target") and interface.extra_inputs == ("target",)
    assert layers[-1].wiring.dependencies == ("target",)  # read where the loss is computed
    assert layers[-1].wiring.out_variables == interface.outputs == ("output.1", "output.2")  # the loss, the target
    main_input, inputs = interface.bind((x,), {"target": target})
    assert main_input is x and inputs == {"target": target}
    adapters = [LayerAdapter(layer.module, layer.wiring.out_variables) for layer in layers]
    saved = dict(inputs)
    main = run_chain(adapters, [layer.wiring for layer in layers], x, saved)
    result = interface.build(main, [saved[name] for name in interface.outputs])
    expected = model(x, target=target)
    assert result.keys() == expected.keys() and result["rows"] == 3 and torch.equal(result["target"], target)
    assert torch.equal(result["y"], expected["y"]) and torch.equal(result["loss"], expected["loss"])


@pytest.mark.parametrize("args, kwargs, expected", [
    ((torch.randn(3, 2),), {}, r"the deployed model takes \['x', 'target'\], as its example had them; \['target'\] "
                               "missing"),
    ((torch.randn(3, 2), torch.randn(3, 2)), {"weight": torch.ones(3)}, "argument 'weight' was not given when the "
                                                                        "model was deployed"),
    ((torch.randn(3, 2),), {"target": 1.0}, "argument 'target' must be a tensor, got float"),
    ((torch.randn(3, 2),), {"aim": 1.0}, "got an unexpected keyword argument 'aim'"),
    ((torch.randn(3, 2), torch.randn(3, 2)), {"scale": 2.0}, "argument 'scale' was not given when the model was "
                                                              "deployed, so its graph keeps its default"),
])
def test_a_call_that_does_not_fit_the_deployed_arguments_is_refused(args, kwargs, expected):
    _, interface = whole_model_layers(Scored(), (torch.randn(3, 2),), {"target": torch.randn(3, 2)})
    with pytest.raises(InvalidArgument, match=expected):
        interface.bind(args, kwargs)
