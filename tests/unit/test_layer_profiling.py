"""shard_service.layer_profiling: a shard measures captured layers on its own device, from their programs and the
shapes of their example inputs, with zero weights, and refuses requests no coordinator would send."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from client_sdk import layers as layer_tools
from shard_service import layer_profiling
from shard_service.layer_profiling import MAX_REPEATS, profile_layers
from shardtrain.errors import InvalidArgument


@pytest.fixture(scope="module")
def captured():
    model = nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    layers = layer_tools.layers_of(model)
    example = torch.zeros(8, 5, dtype=torch.long)
    programs = layer_tools.capture_model(model, layers, example)
    layer_tools.describe_inputs(model, layers, programs, example)
    return programs


def test_each_layer_is_timed_and_its_saved_activations_counted(captured):
    profiles = profile_layers(captured, 2, torch.device("cpu"))
    assert len(profiles) == 4 and all(profile.microseconds >= 1 for profile in profiles)
    assert profiles[0].activation_bytes == 8 * 5 * 8  # the embedding saves its int64 indexes
    assert profiles[1].activation_bytes == 8 * 5 * 16 * 4  # a Linear saves its input, not its weight
    assert profiles[3].activation_bytes == 8 * 5 * 64 * 4


def test_identical_layers_are_measured_once(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    layers = layer_tools.layers_of(model)
    example = torch.zeros(3, 8)
    programs = layer_tools.capture_model(model, layers, example)
    layer_tools.describe_inputs(model, layers, programs, example)
    measured = []
    real = layer_profiling._profile
    monkeypatch.setattr(layer_profiling, "_profile",
                        lambda layer, *rest: measured.append(layer.index) or real(layer, *rest))
    profiles = profile_layers(programs, 1, torch.device("cpu"))
    assert measured == [0, 3]  # the three 8x8 blocks share one program and one example shape; the head differs
    assert profiles[0] == profiles[1] == profiles[2] and profiles[3].activation_bytes == 3 * 8 * 4


def test_requests_no_coordinator_would_send_are_refused(captured):
    layer = type(captured[1])()
    layer.CopyFrom(captured[1])
    del layer.example_inputs[:]
    with pytest.raises(InvalidArgument, match="layer 1 takes 1 inputs; its example_inputs give 0"):
        profile_layers([layer], 1, torch.device("cpu"))
    layer.CopyFrom(captured[1])
    layer.example_inputs[0].shape[:] = [8, 5, 17]
    with pytest.raises(InvalidArgument, match=r"layer 1 example input 0: expected float32 of shape \[batch, .*16\]"):
        profile_layers([layer], 1, torch.device("cpu"))
    layer.example_inputs[0].shape[:] = [1 << 20, 1 << 20, 16]
    with pytest.raises(InvalidArgument, match="layer 1: its example inputs exceed 1024 MiB"):
        profile_layers([layer], 1, torch.device("cpu"))
    with pytest.raises(InvalidArgument, match=f"repeats must be within 1..{MAX_REPEATS}, got 0"):
        profile_layers(captured, 0, torch.device("cpu"))


def test_a_layer_whose_warm_up_is_long_is_timed_once(captured, monkeypatch):
    runs = []
    original = layer_profiling._forward_backward
    monkeypatch.setattr(layer_profiling, "_forward_backward", lambda *args: runs.append(original(*args)) or runs[-1])
    monkeypatch.setattr(layer_profiling, "LONG_RUN", 0.0)
    profile_layers(captured[:1], 3, torch.device("cpu"))
    assert len(runs) == 2  # the warm-up, then one timed run
    runs.clear()
    monkeypatch.setattr(layer_profiling, "LONG_RUN", 60.0)
    profile_layers(captured[:1], 3, torch.device("cpu"))
    assert len(runs) == 4
