"""Benchmark: stages balanced by measured time against stages balanced by parameter count, on a GPT.

    python -m bench.partition [--steps 5] [--stages 3]

The GPT of examples/gpt.py with a large vocabulary, so that its token embedding (a lookup: many parameters,
little time) and its LM head (a large matrix product) weigh very differently in parameters and in time, and
both differ from a block. Each balance deploys it over the same shards and runs `train_step` (1F1B, 4
micro-batches, the loss computed inside the model). Balancing by time, each shard measures every layer on a
micro-batch of the example before the cut is chosen. Printed per balance: which units each stage holds, each
stage's busy time (forward + backward, as the shard measured it, last step), the slowest stage's over the mean (1.00 is perfect balance), and the
median step time. All stages share this machine's cores, so a stage's time includes waiting for them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from client_sdk import Cluster  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=8192, block_size=64, n_layer=6, n_head=4, n_embd=128)
BATCH, MICROBATCHES = 32, 4


def run(cluster: Cluster, balance: str, stages: int, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    gpt = GPT(CONFIG)
    x = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
    y = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
    rows = BATCH // MICROBATCHES  # the shards measure each layer on a micro-batch
    model = cluster.deploy(gpt, optimizer=(torch.optim.AdamW, {"lr": 1e-3}), example_inputs=(x[:rows], y[:rows]),
                           num_stages=stages, balance=balance)
    model.train_step((x, y), loss_output=1, microbatches=MICROBATCHES, schedule="1f1b")  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model.train_step((x, y), loss_output=1, microbatches=MICROBATCHES, schedule="1f1b")
        times.append(time.perf_counter() - start)
    busy = [s["forward_s"] + s["backward_s"] for s in sorted(model.stats(), key=lambda s: s["stage"])]
    print(f"balance={balance}")
    for placement, seconds in zip(model.placements, busy):
        names = [name.split(" ")[0] for name in placement.layers]
        print(f"   stage {placement.stage}: {seconds * 1e3:7.1f} ms busy  {names[0]} .. {names[-1]} "
              f"({len(names)} units, {placement.cost:g} {placement.cost_unit})")
    ratio = max(busy) / statistics.mean(busy)
    step = statistics.median(times)
    print(f"   slowest/mean {ratio:.2f}, step {step * 1e3:.0f} ms (median of {steps})")
    return ratio, step


def main() -> None:
    parser = argparse.ArgumentParser(description="measured balance against parameter-count balance")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stages", type=int, default=3)
    args = parser.parse_args()
    with Cluster.local(num_shards=args.stages) as cluster:
        results = {balance: run(cluster, balance, args.stages, args.steps) for balance in ("parameters", "time")}
    (by_parameters, step_parameters), (by_time, step_time) = results["parameters"], results["time"]
    print(f"slowest/mean: time {by_time:.2f} vs parameters {by_parameters:.2f} (target: time <= 1.15); "
          f"step time: time / parameters = {step_time / step_parameters:.2f}")


if __name__ == "__main__":
    main()
