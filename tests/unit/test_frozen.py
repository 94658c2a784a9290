"""client_sdk.frozen: the Python values a forward reads that a capture fixes."""

from __future__ import annotations

import random

import torch
from torch import nn

from client_sdk.frozen import frozen_reads


class Noisy(nn.Module):
    """Reads a float and a bool of its own, a torch layer's float (configuration), and Python's random."""

    def __init__(self):
        super().__init__()
        self.temperature, self.flip, self.heads = 0.5, True, 4
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        x = self.drop(x) / self.temperature
        if random.random() < 2 and self.flip:
            x = -x
        return x * self.heads


def test_floats_bools_and_random_draws_of_the_models_own_code_are_named():
    model, draw = Noisy(), random.random
    assert frozen_reads(model, lambda: model(torch.ones(2))) == ["Noisy.temperature = 0.5", "random.random()",
                                                                "Noisy.flip = True"]
    assert type(model) is Noisy and random.random is draw  # all put back


def test_a_model_of_torch_layers_reads_nothing_a_capture_fixes():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.BatchNorm1d(2))
    assert frozen_reads(model, lambda: model(torch.ones(3, 2))) == []
