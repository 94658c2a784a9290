"""Benchmark: training data read by the shards themselves (DataSource) against the same data read by this process
and sent to them, with replicas.

    python -m bench.data_source [--replicas 2] [--rows 4096] [--features 2048] [--batch 512] [--rounds 3]
                                [--simulate-compute-ms 0] [--separate-hosts]

A dataset of `--rows` rows of `--features` float32 inputs and 16 targets, in 8 safetensors files; a two-layer
model of two stages, `--replicas` replicas. Each round runs one epoch of model.fit both ways, in turn:
- files: fit(DataSource(...)): every replica's first stage reads its inputs, its last stage its targets;
- client: fit over the same batches read here (batch.read(), as a DataLoader would) and sent by train_step.
Printed: the median samples/s of each way and their ratio. --separate-hosts puts each shard in a network
namespace of its own (root), so the client's batches take the path between hosts rather than shared memory.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import statistics
import tempfile
import time

import torch
from torch import nn

from client_sdk import Cluster, DataSource
from shardtrain.checkpoint import write_safetensors

FILES = 8


def write_dataset(directory: str, rows: int, features: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for index, part in enumerate(torch.arange(rows).tensor_split(FILES)):
        x = torch.randn(len(part), features, generator=generator)
        write_safetensors(pathlib.Path(directory, f"part-{index:03d}.safetensors"),
                          {"x": x, "y": torch.tanh(x[:, :16])})


class ReadHere:
    """The batches of a DataSource read in this process, pass after pass."""

    def __init__(self, source: DataSource):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self):
        return (batch.read() for batch in self.source)


def measure(args, directory: str, hosts=None) -> dict[str, list[float]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(args.features, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 16))
    rates: dict[str, list[float]] = {"files": [], "client": []}
    with Cluster.local(num_shards=2 * args.replicas, data_roots=[directory], hosts=hosts) as cluster:
        model = cluster.deploy(net, optimizer=(torch.optim.SGD, {"lr": 1e-3}), num_stages=2, replicas=args.replicas)
        sources = {"files": DataSource(directory, batch_size=args.batch, seed=1)}
        sources["client"] = ReadHere(DataSource(directory, batch_size=args.batch, seed=1))
        for way, source in sources.items():  # a first pass each: connections, threads, file caches
            model.fit(source, microbatches=args.microbatches, progress=False)
        for _ in range(args.rounds):
            for way, source in sources.items():
                start = time.perf_counter()
                model.fit(source, microbatches=args.microbatches, progress=False)
                model.synchronize()
                rates[way].append(args.rows / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--features", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256, help="the first layer's outputs: the compute per row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--simulate-compute-ms", type=float, default=0.0,
                        help="each pipelined forward and backward on the shards takes this much longer (GPU work)")
    parser.add_argument("--separate-hosts", action="store_true",
                        help="each shard in a network namespace of its own (needs root)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ["SHARDTRAIN_SIMULATE_COMPUTE_MS"] = str(args.simulate_compute_ms)  # read by the shards started
    with tempfile.TemporaryDirectory(prefix="shardtrain-bench-data-") as directory:
        write_dataset(directory, args.rows, args.features)
        megabytes = args.rows * (args.features + 16) * 4 / 2**20
        print(f"{args.rows} rows x {args.features} features ({megabytes:.0f} MiB), batches of {args.batch}, "
              f"{args.replicas} replicas of 2 stages, {args.microbatches} micro-batches, "
              f"{'separate hosts' if args.separate_hosts else 'one host'}, "
              f"simulated compute {args.simulate_compute_ms:g} ms")
        if args.separate_hosts:
            from bench.namespaces import SeparateHosts
            with SeparateHosts(2 * args.replicas) as hosts:
                rates = measure(args, directory, hosts)
        else:
            rates = measure(args, directory)
    files, client = statistics.median(rates["files"]), statistics.median(rates["client"])
    print(f"samples/s: files {files:.0f}, client {client:.0f}, ratio files/client {files / client:.2f}x "
          f"(medians of {args.rounds})")


if __name__ == "__main__":
    main()
