"""client_sdk.interface: a deployment called as its model is, and train_step's loss output found by index or key."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from client_sdk.interface import Interface
from client_sdk.layers import whole_model_layers
from shardtrain.errors import InvalidArgument


class LossInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None):
        out = self.second(torch.relu(self.first(x)))
        loss = None if target is None else nn.functional.mse_loss(out, target)
        return {"out": out, "loss": loss, "scale": 2}


def interface_of(*args) -> Interface:
    return whole_model_layers(LossInside(), args, {})[1]


def test_the_loss_output_is_found_by_key_and_a_constant_or_missing_key_is_refused():
    interface = interface_of(torch.randn(4, 3), torch.randn(4, 2))
    assert interface.inputs == ("x", "target") and interface.output_name("out") == "output"
    assert interface.output_name("loss") == interface.outputs[0]
    with pytest.raises(InvalidArgument, match=r"output 'scale' was the constant 2 when the model was deployed"):
        interface.output_name("scale")
    with pytest.raises(InvalidArgument, match=r"the model returns a dict of \['out', 'loss', 'scale'\]: it has no "
                                              "output 'logits'"):
        interface.output_name("logits")
    without_target = interface_of(torch.randn(4, 3))
    with pytest.raises(InvalidArgument, match="output 'loss' was the constant None.*deploy with the example inputs"):
        without_target.output_name("loss")


def test_a_model_of_one_output_names_it_by_zero_and_binds_one_tensor():
    plain = Interface()
    assert plain.output_name(0) == "output"
    with pytest.raises(InvalidArgument, match="this model returns one tensor: its loss output is 0, got 1"):
        plain.output_name(1)
    x = torch.zeros(2, 3)
    assert plain.bind((x,), {}) == (x, {})
    with pytest.raises(InvalidArgument, match="this model takes one tensor, got 2 arguments"):
        plain.bind((x, x), {})
