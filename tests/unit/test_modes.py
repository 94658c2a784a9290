"""client_sdk.modes: which layers read their train/eval mode, and a model left as it was found."""

from __future__ import annotations

import torch
from torch import nn

from client_sdk import modes
from tests.unit.test_layers import CountsCalls, TrainingNoise


def test_mode_reads_sees_a_read_anywhere_inside_and_puts_every_class_back():
    inner = TrainingNoise()
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(inner))
    with modes.ModeReads(model) as reads:
        model[0](torch.randn(2, 3))
        assert not reads.seen
        inner.training = False  # a write is not a read, and it sticks
        assert not reads.seen
        model(torch.randn(2, 3))
        assert reads.seen
    assert (type(model), type(model[0]), type(model[1]), type(inner)) == (nn.Sequential, nn.Linear, nn.Sequential,
                                                                          TrainingNoise)
    assert not inner.training and model.training


def test_mode_reads_puts_the_classes_back_when_the_forward_raises():
    model = nn.Sequential(nn.Linear(3, 3))
    try:
        with modes.ModeReads(model):
            model(torch.randn(2, 4))  # the wrong width
    except RuntimeError:
        pass
    assert type(model) is nn.Sequential and type(model[0]) is nn.Linear


def test_untouched_puts_back_buffers_even_reassigned_ones_modes_and_the_random_stream():
    model = nn.Sequential(nn.BatchNorm1d(3), CountsCalls())
    model[0].eval()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    calls, random_state = model[1].calls, torch.get_rng_state()
    with modes.untouched(model):
        model.train()
        model(torch.randn(4, 3))
        torch.rand(3)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert model[1].calls is calls and torch.equal(torch.get_rng_state(), random_state)
    assert model.training and not model[0].training and model[1].training


def test_mixed_modes_names_the_layers_in_the_other_mode():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.BatchNorm1d(3), nn.Dropout()))
    assert modes.mixed_modes(model) == []
    model[1][0].eval()
    assert modes.mixed_modes(model) == ["1.0"]
    model.eval()
    assert modes.mixed_modes(model) == []
