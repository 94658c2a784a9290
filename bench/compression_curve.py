"""The accuracy cost of wire compression: the seed residual model's training curve under each encoding.

    python -m bench.compression_curve [--steps 300] [--batch 256] [--every 50]

Trains TEST_RESIDUAL_SMALL on 3 local shards from the same initial weights and the same batches
(a fresh batch of y = (sin 3x + 1)/2 per step, Adam lr 3e-3) once per wire encoding, every tensor
kind compressed, and prints the loss every --every steps (mean of the last --every steps), the
held-out loss at the end, and the largest weight difference from exact training.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from bench.rpc_baseline import _make_data  # noqa: E402
from client_sdk import Cluster, LayerList  # noqa: E402
from client_sdk.seed_models import TEST_RESIDUAL_SMALL  # noqa: E402

ENCODINGS = ("none", "fp16", "bf16", "int8")


def train(cluster: Cluster, encoding: str, initial: dict, steps: int, batch: int) -> tuple[list[float], dict]:
    """Per-step losses and the final weights of one run with every tensor kind under `encoding`."""
    model = cluster.deploy(TEST_RESIDUAL_SMALL, optimizer=(torch.optim.Adam, {"lr": 3e-3}), compression=encoding)
    model.load_state_dict(initial)
    losses = []
    for step in range(steps):
        x, y = _make_data(batch, seed=step + 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        model.step()
        model.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def held_out_loss(weights: dict) -> float:
    """Exact (one-process) loss of the trained weights on data no run trained on."""
    net = LayerList(TEST_RESIDUAL_SMALL)
    net.load_state_dict(weights)
    x, y = _make_data(4096, seed=10**6)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(net(x), y).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--every", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    initial = LayerList(TEST_RESIDUAL_SMALL).state_dict()
    runs = {}
    with Cluster.local(num_shards=3) as cluster:
        for encoding in ENCODINGS:
            runs[encoding] = train(cluster, encoding, initial, args.steps, args.batch)
    marks = range(args.every, args.steps + 1, args.every)
    print("mean training loss over the steps up to each mark; held-out loss and weight drift at the end")
    print(f"{'encoding':>8} " + " ".join(f"{f'@{m}':>9}" for m in marks) + f" {'held-out':>9} {'max |dw|':>9}")
    exact_weights = runs["none"][1]
    for encoding, (losses, weights) in runs.items():
        curve = " ".join(f"{sum(losses[m - args.every:m]) / args.every:9.2e}" for m in marks)
        drift = max((weights[k] - exact_weights[k]).abs().max().item() for k in weights)
        print(f"{encoding:>8} {curve} {held_out_loss(weights):9.2e} {drift:9.2e}")


if __name__ == "__main__":
    main()
