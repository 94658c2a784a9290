"""`shardtrain demo`: train the seed's residual model on a local 3-shard cluster (or a running one, with
--coordinator) and check it against one process."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

import torch

from client_sdk.cluster import Cluster
from client_sdk.layer_list import LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL

TOLERANCE = 1e-5


def batches(steps: int, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed regression data: y = (sin 3x + 1) / 2 for x in [-1, 1)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.rand(batch, 1, generator=generator) * 2 - 1
        yield x, (torch.sin(3 * x) + 1) / 2


def progress(step: int, total: int, loss: float, started: float) -> None:
    """A self-overwriting progress bar on a terminal; a line every tenth of the run elsewhere (logs, CI)."""
    interactive = sys.stdout.isatty()
    if not interactive and (step + 1) % max(1, total // 10) and step + 1 != total:
        return
    width = 30
    filled = width * (step + 1) // total
    rate = (step + 1) / max(time.perf_counter() - started, 1e-9)
    line = f"[{'#' * filled}{'.' * (width - filled)}] {step + 1}/{total}  loss {loss:.5f}  {rate:.0f} steps/s"
    sys.stdout.write(f"\r{line}" if interactive else f"{line}\n")
    sys.stdout.flush()


def train_distributed(cluster: Cluster, reference: LayerList, args) -> tuple[dict, list[float]]:
    """Deploys a copy of `reference`'s weights and trains it; returns the final weights and the losses."""
    model = cluster.deploy(reference, optimizer=(torch.optim.Adam, {"lr": args.lr}), num_stages=args.shards)
    print("\nwhere each layer runs:")
    for placement in model.placements:
        for offset, layer in enumerate(placement.layers):
            print(f"  layer {placement.first_layer + offset}  stage {placement.stage}  "
                  f"{placement.shard_address:<21} {layer}")
    print()
    losses, started = [], time.perf_counter()
    for step, (x, y) in enumerate(batches(args.steps, args.batch, args.seed)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        model.step()
        model.zero_grad()
        losses.append(loss.item())
        progress(step, args.steps, losses[-1], started)
    if sys.stdout.isatty():
        print()
    return model.state_dict(), losses


def train_locally(reference: LayerList, args) -> dict:
    """The same training in this one process."""
    optimizer = torch.optim.Adam(reference.parameters(), lr=args.lr)
    for x, y in batches(args.steps, args.batch, args.seed):
        torch.nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return reference.state_dict()


def demo_parser() -> argparse.ArgumentParser:
    """The flags of `shardtrain demo`."""
    parser = argparse.ArgumentParser(prog="shardtrain demo", description=__doc__)
    parser.add_argument("--shards", type=int, default=3,
                        help="shards to train on (default 3): started locally, or waited for at --coordinator")
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--batch", type=int, default=32, help="samples per step (default 32)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    parser.add_argument("--coordinator", default="",
                        help="host:port of a running coordinator to train on, with the token and TLS settings of "
                             "the SHARDTRAIN_AUTH_TOKEN[_FILE] and SHARDTRAIN_TLS_* variables (default: start a "
                             "local cluster on 127.0.0.1)")
    parser.add_argument("--wait", type=float, default=120.0,
                        help="with --coordinator: seconds to wait for --shards shards to register (default 120)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `shardtrain demo`."""
    args = demo_parser().parse_args(sys.argv[1:] if argv is None else argv)
    torch.manual_seed(args.seed)
    reference = LayerList(TEST_RESIDUAL_SMALL)
    if args.coordinator:
        print(f"training on the cluster at {args.coordinator}: waiting for {args.shards} shards ...")
        with Cluster.connect(args.coordinator) as cluster:
            cluster.wait_for_shards(args.shards, timeout=args.wait)
            trained, losses = train_distributed(cluster, reference, args)
    else:
        print(f"starting a coordinator and {args.shards} shards on 127.0.0.1 ...")
        with Cluster.local(num_shards=args.shards) as cluster:
            trained, losses = train_distributed(cluster, reference, args)
    return report(reference, trained, losses, args)


def report(reference: LayerList, trained: dict, losses: list[float], args) -> int:
    """Prints the loss along the way and how far the weights are from one process's; 0 when they match."""
    checkpoints = sorted({0, len(losses) // 4, len(losses) // 2, 3 * len(losses) // 4, len(losses) - 1})
    print("loss: " + "  ".join(f"step {i}: {losses[i]:.5f}" for i in checkpoints))
    expected = train_locally(reference, args)
    worst = max((trained[k] - expected[k]).abs().max().item() for k in expected)
    verdict = "match" if worst <= TOLERANCE else "DIFFER"
    print(f"weights vs the same training in one process: largest difference {worst:.2e} -> {verdict} "
          f"(tolerance {TOLERANCE:g})")
    return 0 if worst <= TOLERANCE else 1
