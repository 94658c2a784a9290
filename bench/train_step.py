"""Issue-2 benchmark: median training-step time of the seed residual model, three ways, in one run.

    python bench/train_step.py [--batches 32 256] [--steps 60]

1. one process (the baseline; its best of 1 and 2 torch threads),
2. shardtrain on 3 local shard processes,
3. torch.distributed.rpc + distributed autograd + DistributedOptimizer on 3 worker processes.
Prints the medians and the ratios shardtrain/one-process and shardtrain/torch.rpc.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from bench.rpc_baseline import _make_data, run_rpc_baseline
from client_sdk import Cluster, LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL

LR = 3e-3


def timed_steps(step: Callable[[], None], steps: int, warmup: int) -> list[float]:
    """Wall time of each of `steps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def single_process(batch: int, steps: int, warmup: int, threads: int) -> float:
    """Median step of the whole model in this process with `threads` intra-op threads."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LayerList(TEST_RESIDUAL_SMALL)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = _make_data(batch, 0)

    def step() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return statistics.median(timed_steps(step, steps, warmup))


def shardtrain(cluster: Cluster, batch: int, steps: int, warmup: int) -> float:
    """Median step of the model deployed over the cluster's shards."""
    torch.manual_seed(0)
    model = cluster.deploy(TEST_RESIDUAL_SMALL, optimizer=(torch.optim.Adam, {"lr": LR}))
    x, y = _make_data(batch, 0)

    def step() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.step()
        model.zero_grad()
    return statistics.median(timed_steps(step, steps, warmup))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    rows = []
    with Cluster.local(num_shards=3) as cluster:
        for batch in args.batches:
            ours = shardtrain(cluster, batch, args.steps, args.warmup)
            single = {t: single_process(batch, args.steps, args.warmup, t) for t in (1, 2)}
            rows.append((batch, min(single.values()), single, ours))
    print(f"{'batch':>5} {'1 process':>10} {'(1 thr / 2 thr)':>16} {'shardtrain':>11} {'torch.rpc':>10} "
          f"{'st/1proc':>9} {'st/rpc':>7}")
    for batch, single, by_threads, ours in rows:
        rpc = statistics.median(run_rpc_baseline(batch, args.steps, args.warmup))
        print(f"{batch:5d} {single * 1e3:8.2f}ms {by_threads[1] * 1e3:7.2f}/{by_threads[2] * 1e3:.2f}ms "
              f"{ours * 1e3:9.2f}ms {rpc * 1e3:8.2f}ms {ours / single:8.2f}x {ours / rpc:6.2f}x")


if __name__ == "__main__":
    main()
