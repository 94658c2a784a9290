"""Benchmark: how long training stops when a shard of a replicated deployment dies.

    python -m bench.recovery [--sizes-mb 10 200] [--rounds 3] [--steps 5] [--snapshot-every 10]

Two replicas of a two-stage model on four shards, plus a spare; Adam, so every stage holds its weights and
twice as much optimizer state. Each round SIGKILLs one shard (stage and replica in turn) right after a step
settled, then times the next train_step: it finds the dead shard, has every survivor snapshot its stage,
deploys again with the spare in the dead shard's place, restores every stage (the spare's from a live replica,
over the network; the others from their own snapshot) and runs the step. A new spare is started for the next
round. Printed per stage size: the median of those steps (the recovery), the median of normal steps in the same
run, the part of the recovery before the step ran again (from finding the dead shard to every stage restored:
model.recoveries[i].seconds) and the bytes the spare received.

Then, without replicas, what deploy(snapshot_every=K) costs: the time of a run of train_steps with a snapshot
every K of them against one without, on two shards; per snapshot (a drain of the pipeline, every stage's copy of
its state, and that copy streamed to the next stage's shard), and as a share of the run at K and at K = 50.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import time

import torch
from torch import nn

from client_sdk import Cluster

WIDTH = 1024  # each Linear(WIDTH, WIDTH) holds 4 MiB of float32 weights


def model_of(stage_mb: int) -> tuple[nn.Sequential, list[int]]:
    """Two stages of `stage_mb` MiB of weights each (whole Linear layers, at least one), and where the second
    starts."""
    per_stage = max(1, round(stage_mb / (WIDTH * WIDTH * 4 / 2**20)))
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(2 * per_stage)]
    for layer in layers:
        nn.init.normal_(layer.weight, std=WIDTH ** -0.5)  # keeps activations bounded through a deep stack
    return nn.Sequential(*layers), [per_stage]


def measure(stage_mb: int, rounds: int, steps: int) -> dict:
    net, split = model_of(stage_mb)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    normal, recovery = [], []
    with Cluster.local(num_shards=4, spares=1) as cluster:
        model = cluster.deploy(net, optimizer=(torch.optim.Adam, {"lr": 1e-4}), split_points=split, replicas=2)
        model.train_step(x, y, "MSELoss")
        for round_ in range(rounds):
            for _ in range(steps):
                start = time.perf_counter()
                model.train_step(x, y, "MSELoss")
                model.synchronize()
                normal.append(time.perf_counter() - start)
            replica, stage = round_ % 2, (round_ // 2) % 2
            victim = model._trainer.replicas[replica].stages[stage].address
            service = next(s for s in cluster._services.services if s.address == victim)
            service.process.kill()
            start = time.perf_counter()
            model.train_step(x, y, "MSELoss")
            model.synchronize()
            recovery.append(time.perf_counter() - start)
            service.process.wait()
            cluster._services.add_shard()  # the next round's spare
        logs = cluster._services.log_dir
        done = model.recoveries
    shutil.rmtree(logs, ignore_errors=True)  # kept at close, as after any dead shard: these died on purpose
    stage_mb = split[0] * (WIDTH * WIDTH + WIDTH) * 4 / 2**20  # what the whole layers hold
    state_mb = stage_mb * 3  # weights and Adam's two moments
    assert len(done) == rounds, f"{rounds} shards were killed but {len(done)} recoveries are recorded"
    return {"stage_mb": stage_mb, "state_mb": state_mb, "recovery_s": statistics.median(recovery),
            "restore_s": statistics.median(r.seconds for r in done), "step_s": statistics.median(normal),
            "moved_mb": statistics.median(r.bytes_moved for r in done) / 2**20, "all_recoveries": recovery}


def snapshot_cost(stage_mb: int, every: int, steps: int, rounds: int) -> dict:
    """Without replicas: the time of `steps` train_steps with a snapshot every `every` of them (each stage's
    own, and a copy on the next stage's shard) against none, deployments taking turns on one cluster."""
    net, split = model_of(stage_mb)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    times: dict[int, list[float]] = {0: [], every: []}
    with Cluster.local(num_shards=2) as cluster:
        for _ in range(rounds):
            for k in (0, every):
                model = cluster.deploy(net, optimizer=(torch.optim.Adam, {"lr": 1e-4}), split_points=split,
                                       snapshot_every=k)
                model.train_step(x, y, "MSELoss")  # warm-up, and the first snapshots
                model.synchronize()
                start = time.perf_counter()
                for _ in range(steps):
                    model.train_step(x, y, "MSELoss")
                model.synchronize()
                times[k].append(time.perf_counter() - start)
    plain, snapshotted = statistics.median(times[0]), statistics.median(times[every])
    per_snapshot = (snapshotted - plain) / (steps // every)
    step = plain / steps
    return {"step_s": step, "per_snapshot_s": per_snapshot, "overhead": snapshotted / plain - 1,
            "overhead_at_50": per_snapshot / (50 * step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 200], help="weights per stage, MiB")
    parser.add_argument("--rounds", type=int, default=3, help="shards killed, one per round")
    parser.add_argument("--steps", type=int, default=5, help="normal steps timed before each kill")
    parser.add_argument("--snapshot-every", type=int, default=10,
                        help="without replicas: a snapshot every this many steps, timed against none")
    parser.add_argument("--snapshot-steps", type=int, default=20, help="steps timed each way")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    print(f"{'weights/stage':>14} {'+Adam':>8} {'recovery':>10} {'restore':>9} {'normal step':>12} {'ratio':>7} "
          f"{'moved':>9}")
    for size in args.sizes_mb:
        row = measure(size, args.rounds, args.steps)
        ratio = row['recovery_s'] / row['step_s']
        print(f"{row['stage_mb']:>11.0f} MiB {row['state_mb']:>4.0f} MiB {row['recovery_s']:>8.2f} s "
              f"{row['restore_s']:>7.2f} s {row['step_s']:>10.3f} s {ratio:>6.1f}x {row['moved_mb']:>5.0f} MiB  "
              f"(each: {', '.join(f'{t:.2f}' for t in row['all_recoveries'])} s)", flush=True)
    every = args.snapshot_every
    print(f"\nwithout replicas, snapshot_every={every} against none ({args.snapshot_steps} steps each way, "
          "medians of 2 rounds):")
    print(f"{'weights/stage':>14} {'step':>9} {'per snapshot':>13} {f'overhead at {every}':>16} {'at 50':>8}")
    for size in args.sizes_mb:
        cost = snapshot_cost(size, every, args.snapshot_steps, rounds=2)
        print(f"{size:>10} MiB {cost['step_s']:>7.3f} s {cost['per_snapshot_s']:>11.3f} s "
              f"{cost['overhead']:>15.1%} {cost['overhead_at_50']:>8.1%}", flush=True)


if __name__ == "__main__":
    main()
