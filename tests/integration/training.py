"""Helpers to train the same model in one process and over shards, and compare the results."""

from __future__ import annotations

import copy
import torch

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def regression_batches(steps: int, batch: int, features: int, outputs: int = 1, seed: int = 0) -> Batches:
    """Fixed random regression data."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        x = torch.rand(batch, features, generator=generator) * 2 - 1
        data.append((x, torch.sin(3 * x[:, :outputs]) / 2 + 0.5))
    return data


def train_locally(module: torch.nn.Module, batches: Batches, optimizer: tuple) -> dict[str, torch.Tensor]:
    """Trains a deep copy of `module` in this process; returns its state dict."""
    local = copy.deepcopy(module)
    opt = optimizer[0](local.parameters(), **optimizer[1])
    for x, y in batches:
        torch.nn.functional.mse_loss(local(x), y).backward()
        opt.step()
        opt.zero_grad()
    return local.state_dict()


def train_remotely(model, batches: Batches) -> list[float]:
    """Trains a deployed model with the plain PyTorch loop; returns the losses."""
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        model.step()
        model.zero_grad()
        losses.append(loss.item())
    return losses


def largest_difference(trained: dict, expected: dict) -> float:
    """Largest absolute difference over every entry; the key sets must agree."""
    assert list(trained) == list(expected), f"keys differ: {list(trained)} vs {list(expected)}"
    return max((trained[k].float() - expected[k].float()).abs().max().item() for k in expected)
