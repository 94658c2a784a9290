"""Benchmark: a durable checkpoint written and read by every shard at once, against one the SDK gathers.

    python -m bench.checkpoint [--stages 3] [--stage-mb 100] [--rounds 3]

A model of `--stages` stages of `--stage-mb` MiB of weights each, with Adam (so each stage holds three times
that), on shards started with --checkpoint-dir. Each round saves a checkpoint both ways into fresh
directories under it and loads each back: through the shards (`on_shards=True`: each writes and reads its
own part) and through this process (`on_shards=False`: ReadState and ReadOptimizerState to the SDK, one
writer). Printed: the median seconds of each, the ratio, and the bytes per checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

from client_sdk import Cluster

WIDTH = 1024  # each Linear(WIDTH, WIDTH) holds 4 MiB of float32 weights


def measure(stages: int, stage_mb: int, rounds: int, root: str) -> dict[str, list[float]]:
    per_stage = max(1, round(stage_mb / 4))
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(stages * per_stage)])
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    times: dict[str, list[float]] = {f"{what} {way}": [] for what in ("save", "load")
                                     for way in ("shards", "client")}
    with Cluster.local(num_shards=stages, checkpoint_dir=root) as cluster:
        model = cluster.deploy(net, optimizer=(torch.optim.Adam, {"lr": 1e-4}),
                               split_points=[per_stage * s for s in range(1, stages)])
        model.train_step(x, y, "MSELoss")  # Adam's moments exist
        model.synchronize()
        for round_ in range(rounds):
            for way, on_shards in (("shards", True), ("client", False)):
                directory = os.path.join(root, f"{way}-{round_}")
                start = time.perf_counter()
                model.save_checkpoint(directory, on_shards=on_shards)
                times[f"save {way}"].append(time.perf_counter() - start)
                start = time.perf_counter()
                model.load_checkpoint(directory, on_shards=on_shards)
                times[f"load {way}"].append(time.perf_counter() - start)
                shutil.rmtree(directory)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--stage-mb", type=int, default=100, help="weights per stage, MiB (Adam adds twice that)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="", help="where the shards write (default: a temporary directory)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    root = args.dir or tempfile.mkdtemp(prefix="bench-checkpoint-")
    try:
        times = measure(args.stages, args.stage_mb, args.rounds, os.path.abspath(root))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    total_mb = args.stages * max(1, round(args.stage_mb / 4)) * 4 * 3
    print(f"{args.stages} stages x {args.stage_mb} MiB of weights, with Adam: {total_mb} MiB per checkpoint; "
          f"medians of {args.rounds} rounds")
    for what in ("save", "load"):
        shards, client = (statistics.median(times[f"{what} {way}"]) for way in ("shards", "client"))
        print(f"{what}: shards {shards:.3f} s, client {client:.3f} s, ratio shards/client {shards / client:.2f}x "
              f"({total_mb / shards:.0f} against {total_mb / client:.0f} MiB/s)", flush=True)


if __name__ == "__main__":
    main()
