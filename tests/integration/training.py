"""Helpers to train the same model in one process and over shards, and compare the results."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import torch
from torch import nn

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def regression_batches(steps: int, batch: int, features: int, outputs: int = 1, seed: int = 0) -> Batches:
    """Fixed random regression data."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        x = torch.rand(batch, features, generator=generator) * 2 - 1
        data.append((x, torch.sin(3 * x[:, :outputs]) / 2 + 0.5))
    return data


def train_copy(module: torch.nn.Module, batches: Batches, optimizer: tuple):
    """Trains a deep copy of `module` in this process; returns (the copy, its optimizer)."""
    local = copy.deepcopy(module)
    opt = optimizer[0](local.parameters(), **optimizer[1])
    for x, y in batches:
        torch.nn.functional.mse_loss(local(x), y).backward()
        opt.step()
        opt.zero_grad()
    return local, opt


def train_locally(module: torch.nn.Module, batches: Batches, optimizer: tuple) -> dict[str, torch.Tensor]:
    """Trains a deep copy of `module` in this process; returns its state dict."""
    return train_copy(module, batches, optimizer)[0].state_dict()


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


def train_side_by_side(model, local: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, loss_fn) -> None:
    """Trains a deployed model with the plain PyTorch loop and `local` with `optimizer` on the same batches."""
    for x, y in batches:
        loss_fn(model(x), y).backward()
        model.step()
        model.zero_grad()
        loss_fn(local(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def trains_like_one_process(cluster, num_stages: int) -> float:
    """Deploys a small MLP over `num_stages` shards, trains it a few steps with Adam, and returns how far its
    weights end from the same training in one process (a check that a cluster still works as it should)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = (torch.optim.Adam, {"lr": 0.01})
    batches = regression_batches(steps=4, batch=8, features=3)
    expected = train_locally(net, batches, optimizer)
    model = cluster.deploy(net, optimizer=optimizer, num_stages=num_stages)
    train_remotely(model, batches)
    return largest_difference(model.state_dict(), expected)


def largest_difference(trained: dict, expected: dict) -> float:
    """Largest absolute difference over every entry; the key sets must agree."""
    assert list(trained) == list(expected), f"keys differ: {list(trained)} vs {list(expected)}"
    return max((trained[k].float() - expected[k].float()).abs().max().item() for k in expected)


class SkipAdd(nn.Module):
    """A Linear that adds a saved residual to its output (unlike the seed's layer, it keeps the sum)."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x, residual):
        return self.linear(x) + residual


# A residual saved by layer 0 and used by layer 4: with split_points=[2, 4] it skips stage 1 entirely.
SKIP_A_STAGE = [
    (nn.Linear, {"in_features": 3, "out_features": 8, "out_variables": ["skip"]}, (4, 3)),
    (nn.Tanh, {}, (4, 8)),
    (nn.Linear, {"in_features": 8, "out_features": 8}, (4, 8)),
    (nn.Tanh, {}, (4, 8)),
    (SkipAdd, {"features": 8, "dependencies": ["skip"]}, [(4, 8), (4, 8)]),
    (nn.Linear, {"in_features": 8, "out_features": 1}, (4, 8)),
]


def interrupted_script(path) -> str:
    """Runs the Python script at `path` as a terminal's foreground job runs (a process group of its own, Ctrl-C's
    default action), sends the group Ctrl-C's SIGINT a second after the script printed "training", and returns what
    it printed after that; the script must then exit with 0 within two minutes."""
    client = subprocess.Popen([sys.executable, "-c", _WITH_CTRL_C, str(path)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert client.stdout.readline() == "training\n"
        time.sleep(1.0)  # into the training, on purpose: not a wait for anything
        os.killpg(client.pid, signal.SIGINT)
        output, _ = client.communicate(timeout=120)
        assert client.returncode == 0
    finally:
        client.kill()
        client.wait()
    return output


# Runs the script with Python's own Ctrl-C handler (KeyboardInterrupt). A shell starts background jobs with SIGINT
# ignored, a child inherits that, and Python leaves an ignored SIGINT ignored, so the script would never see the Ctrl-C
# a terminal sends. Set in the child's own interpreter: a preexec_fn would run Python between fork and exec in this
# process, whose gRPC threads make that crash now and then.
_WITH_CTRL_C = ("import os, runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "sys.argv = sys.argv[1:]; sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0])); "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
