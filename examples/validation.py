"""Training with a validation pass: BatchNorm and Dropout on 3 shards, model.train() and model.eval().

    python examples/validation.py

Each epoch trains in training mode (Dropout drops, BatchNorm normalises by the batch and updates its
running statistics on the shards), then measures the held-out loss in eval mode under
torch.no_grad(), which changes nothing on the shards. At the end the same held-out loss is computed
in this process from the gathered weights and running statistics, as a check.
"""

import copy

import torch
from torch import nn

from client_sdk import Cluster


def data(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.rand(rows, 2, generator=generator) * 2 - 1
    return x, torch.sin(3 * x[:, :1]) * torch.cos(2 * x[:, 1:])


def main(epochs: int = 20, batches_per_epoch: int = 20) -> tuple[float, float]:
    """Trains; returns (the held-out loss on the shards, the same computed in this process)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1),
                        nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))
    held_out = data(512, generator)
    with Cluster.local(num_shards=3) as cluster:
        model = cluster.deploy(net, optimizer=(torch.optim.Adam, {"lr": 3e-3}))
        for epoch in range(epochs):
            model.train()
            for _ in range(batches_per_epoch):
                x, y = data(64, generator)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                model.step()
                model.zero_grad()
            model.eval()
            with torch.no_grad():
                validation = nn.functional.mse_loss(model(held_out[0]), held_out[1]).item()
            if epoch % 5 == 0 or epoch == epochs - 1:
                print(f"epoch {epoch:2d}  last training loss {loss.item():.4f}  held-out loss {validation:.4f}")
        local = copy.deepcopy(net)
        local.load_state_dict(model.state_dict())
    with torch.no_grad():
        here = nn.functional.mse_loss(local.eval()(held_out[0]), held_out[1]).item()
    print(f"held-out loss from the gathered weights in this process: {here:.4f}")
    return validation, here


if __name__ == "__main__":
    main()
