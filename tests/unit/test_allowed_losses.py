"""shardtrain.allowed_losses: which losses may be shipped by name, and how they are rebuilt on a shard."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from shardtrain import allowed_losses
from shardtrain.errors import InvalidArgument


@pytest.mark.parametrize("loss", ["MSELoss", nn.MSELoss, nn.MSELoss()])
def test_a_loss_by_name_class_or_instance(loss):
    kwargs = "{}" if not isinstance(loss, nn.Module) else '{"reduction": "mean"}'
    assert allowed_losses.encode(loss) == ("MSELoss", kwargs)


def test_an_instance_carries_its_arguments():
    name, kwargs = allowed_losses.encode(nn.CrossEntropyLoss(label_smoothing=0.2, reduction="sum"))
    assert name == "CrossEntropyLoss" and json.loads(kwargs)["label_smoothing"] == 0.2
    function, sums = allowed_losses.build(name, kwargs)
    assert sums and isinstance(function, nn.CrossEntropyLoss) and function.label_smoothing == 0.2


@pytest.mark.parametrize("loss", ["TripletMarginLoss", "os.system", nn.TripletMarginLoss(), 3])
def test_losses_outside_the_allow_list_are_refused(loss):
    with pytest.raises(InvalidArgument, match="not allowed|not an allowed"):
        allowed_losses.encode(loss)


def test_class_weights_cannot_travel_by_name():
    with pytest.raises(InvalidArgument, match="class weights"):
        allowed_losses.encode(nn.CrossEntropyLoss(weight=torch.ones(3)))


@pytest.mark.parametrize(("kwargs", "message"), [
    ('{"size_average": true}', "takes keyword arguments"), ("not json", "not JSON"),
    ('{"reduction": "none"}', "reduction must be 'mean' or 'sum'"), ("[1, 2]", "takes keyword arguments")])
def test_bad_arguments_are_invalid(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        allowed_losses.build("MSELoss", kwargs)


def test_build_gives_a_working_loss():
    function, sums = allowed_losses.build("HuberLoss", '{"delta": 0.5}')
    assert not sums
    assert function(torch.zeros(3), torch.ones(3)).item() == pytest.approx(0.375)
