"""Benchmark: shardtrain against torch.distributed.pipelining and DistributedDataParallel, on the same GPT.

    python -m bench.peer [--rounds 3] [--steps 10] [--warmup 2] [--batch 32] [--microbatches 8]
                         [--simulate-compute-ms 0] [--quick]

The model (bench/peer_model.py): a small GPT of 8 pre-norm transformer blocks between a token+position
embedding and a LayerNorm+vocabulary head, cross-entropy over the vocabulary, SGD, the same seed, the same
batches and the same cut on every side: 4 stages of 2 blocks (the embedding with the first, the head with
the last), or 8 pieces of one block for the interleaved schedule. Each row trains it two ways:

- shardtrain: model.train_step(x, y, loss, microbatches=m, schedule=S) on local clusters (Cluster.local):
  4 shards for gpipe, 1f1b and zb-h1 (one deployment, the schedule chosen per call); 4 shard processes
  serving 2 shards each for interleaved (deploy(virtual_stages=2), 8 stages); 2 shards for data parallel
  (deploy(replicas=2, num_stages=1), one micro-batch per replica).
- torch (bench/peer_torch.py): 4 gloo processes with PipelineStage and ScheduleGPipe, Schedule1F1B,
  ScheduleInterleaved1F1B (2 stages per rank), and for zb-h1 torch's schedule runtime
  (_PipelineScheduleRuntime) given shardtrain's own ZB-H1 order (torch's zero-bubble classes need 2 stages
  per rank); DistributedDataParallel on 2 of those processes, each on half of every batch.
Every process computes on cores // processes intra-op threads (Cluster.local's rule for its shards; 1 here).

In each round every row trains both ways, warm-up steps then timed steps, every other round in the
opposite order; each side starts each turn from the seed's weights. A step's time runs from the end of
one step to the end of the next (shardtrain's train_step returns with the loss while its backwards go on);
printed: the median of every timed step of every round, shardtrain's over torch's, and CPU seconds per
step summed over the side's processes (shardtrain: its shards, coordinator and this SDK process; torch: its
ranks), the median over rounds. Every step's loss of every turn must equal one process's (plain training
of the same model on the same batches, micro-batch-accumulated) within a relative 1e-5; the run exits
non-zero if one does not.

--simulate-compute-ms D stands for GPU hosts, where stages do not share cores. Every shard runs with
`--simulate-compute-ms D` (set as SHARDTRAIN_SIMULATE_COMPUTE_MS in the environment of its command:
Cluster.local passes no shard flags), so after each forward and each backward of a micro-batch that
train_step plans it waits D ms more (time.sleep on its compute thread, holding its device), D / 2 after
each half of a split (zb-h1) backward, nothing more for the loss; the torch stages sleep (time.sleep) as long after the
same actions (a PipelineStage subclass; with DistributedDataParallel, after the whole model's forward and
before its backward). Interleaved stages are half a device's share of the model: D / 2 per action, both
sides. The layers still compute for real, on the shared cores.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import threading
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as Cluster.local gives its shards; inherited by every side

import torch  # noqa: E402

from bench.ab import _cpu_seconds  # noqa: E402
from bench.peer_model import (Config, batches, build, layers_per_stage, lm_loss, reference_losses,  # noqa: E402
                              timed_run)
from bench.peer_torch import Job, TorchPool  # noqa: E402
from client_sdk import Cluster  # noqa: E402
from client_sdk.processes import Loopback  # noqa: E402

ROWS = ("gpipe", "1f1b", "zb-h1", "interleaved", "dp")
TORCH_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
               "zb-h1": "_PipelineScheduleRuntime with shardtrain's ZB-H1 order (F, I, W)",
               "dp": "DistributedDataParallel, 2 processes"}
TOLERANCE = 1e-5
QUICK = Config(vocab=64, width=32, heads=2, seq=8, batch=8, microbatches=4, warmup=1, steps=2)


def threads_for(processes: int) -> int:
    """Intra-op threads of each of `processes` processes sharing this host: Cluster.local's rule."""
    return max(1, (os.cpu_count() or 1) // processes)


class SimulatedDevices(Loopback):
    """Every service on 127.0.0.1, each shard waiting `ms` of simulated device time per action: its
    `--simulate-compute-ms`, set in the environment its command runs under (Cluster.local takes no shard flags)."""

    def __init__(self, ms: float):
        self.ms = ms

    def prefix(self, index: int) -> list[str]:
        return ["env", f"SHARDTRAIN_SIMULATE_COMPUTE_MS={self.ms:g}"]  # 0 too: none inherited from this process


class Keeper(threading.Thread):
    """Starts a local cluster and deploys on it, keeps it until released, then closes it: a local cluster's services
    end with the thread that started them. The clusters start (and stop) at once, each filling the others' waits."""

    def __init__(self, start: Callable[[], tuple]):
        super().__init__(daemon=True)
        self._start, self._released, self._done = start, threading.Event(), threading.Event()
        self.result: tuple = ()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._start()
        except BaseException as error:  # raised again in the thread that asks for the result
            self.error = error
        self._done.set()
        self._released.wait()
        if self.result:
            self.result[0].close()

    def get(self) -> tuple:
        """(cluster, deployed model), once started; what the start raised, if it failed."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.result

    @staticmethod
    def release(keepers: list[Keeper]) -> None:
        """Closes every keeper's cluster, all at once."""
        for keeper in keepers:
            keeper._released.set()
        for keeper in keepers:
            keeper.join()


def deployed(config: Config, shards: int, ms: float, virtual: int = 1, **options) -> tuple:
    """(a local cluster of `shards` shard processes, each serving `virtual` shards, the seed's GPT deployed on it)."""
    cluster = Cluster.local(num_shards=shards, virtual_stages=virtual, hosts=SimulatedDevices(ms))
    try:
        return cluster, cluster.deploy(build(config), (torch.optim.SGD, {"lr": config.lr}),
                                       example_input=batches(config)[0][0][:2], **options)
    except BaseException:
        cluster.close()
        raise


class Shardtrain:
    """The shardtrain side: three local clusters, one deployment on each, all started before the rounds."""

    def __init__(self, config: Config, delay_ms: float, stack: contextlib.ExitStack):
        self.config = config
        specs = {"pipe": dict(shards=4, ms=delay_ms, layers_per_stage=layers_per_stage(4)),
                 "interleaved": dict(shards=4, virtual=2, ms=delay_ms / 2, layers_per_stage=layers_per_stage(8),
                                     virtual_stages=2),
                 "dp": dict(shards=2, ms=delay_ms, num_stages=1, replicas=2)}
        keepers = {name: Keeper(functools.partial(deployed, config, **spec)) for name, spec in specs.items()}
        for keeper in keepers.values():
            keeper.start()
        stack.callback(Keeper.release, list(keepers.values()))
        self._models = {name: keeper.get() for name, keeper in keepers.items()}
        self._initial = build(config).state_dict()

    def turn(self, row: str) -> dict:
        """One turn of `row` from the seed's weights: timed_run's figures."""
        cluster, model = self._models[row if row in ("interleaved", "dp") else "pipe"]
        microbatches = 1 if row == "dp" else self.config.microbatches
        model.synchronize()
        model.load_state_dict(self._initial)
        pids = [*cluster._services.pids, os.getpid()]

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            return model.train_step(x, y, lm_loss, microbatches=microbatches, schedule="1f1b" if row == "dp" else row)
        return timed_run(step, batches(self.config), self.config.warmup, lambda: _cpu_seconds(pids),
                         model.synchronize)


def torch_turn(pool: TorchPool, config: Config, row: str, delay: float) -> dict:
    """One turn of `row` on the torch pool: rank 0's step times, every rank's CPU, the step's loss."""
    if row == "dp":
        ranks = pool.run(Job("ddp", config, delay=delay, threads=threads_for(2)))[:2]
        losses = [statistics.fmean(pair) for pair in zip(*(rank["losses"] for rank in ranks))]
    else:
        job = Job("pipeline", config, row, delay / 2 if row == "interleaved" else delay, threads_for(4))
        ranks = pool.run(job)
        losses = ranks[-1]["losses"]  # the last stage's rank computes the loss
    return {"times": ranks[0]["times"], "cpu": sum(rank["cpu"] for rank in ranks), "losses": losses}


def worst_difference(losses: list[float], expected: list[float]) -> float:
    """The largest relative difference between two runs' per-step losses."""
    return max(abs(got - want) / abs(want) for got, want in zip(losses, expected, strict=True))


def summary(turns: list[dict], steps: int) -> dict:
    """A side's figures for one row over every round."""
    return {"step": statistics.median(t for turn in turns for t in turn["times"]),
            "cpu": statistics.median(turn["cpu"] / steps for turn in turns)}


def print_table(results: dict, steps: int) -> None:
    print(f"{'schedule':>12} | {'shardtrain step ms':>18} | {'torch step ms':>13} | {'ratio':>6} | "
          f"{'shardtrain CPU s/step':>21} | {'torch CPU s/step':>16}")
    for row in ROWS:
        ours, theirs = summary(results[row]["shardtrain"], steps), summary(results[row]["torch"], steps)
        name = "dp 2x1" if row == "dp" else row
        print(f"{name:>12} | {ours['step'] * 1e3:18.1f} | {theirs['step'] * 1e3:13.1f} | "
              f"{ours['step'] / theirs['step']:5.2f}x | {ours['cpu']:21.3f} | {theirs['cpu']:16.3f}")


def check_losses(results: dict, expected: dict) -> list[str]:
    """Prints every row's loss check; the failures."""
    failed = []
    for row in ROWS:
        words = []
        for side in ("shardtrain", "torch"):
            worst = max(worst_difference(turn["losses"], expected[row]) for turn in results[row][side])
            words.append(f"{side} {worst:.1e}")
            if not worst <= TOLERANCE:
                failed.append(f"{row} {side} {worst:.2e}")
        verdict = "FAILED" if any(f.startswith(f"{row} ") for f in failed) else "ok"
        print(f"loss check {row}: largest relative difference from one process, every step of every round: "
              f"{', '.join(words)} (tolerance {TOLERANCE:g}): {verdict}")
    return failed


def run_rounds(shardtrain: Shardtrain, pool: TorchPool, config: Config, rounds: int, delay: float) -> dict:
    """Every row both ways in each round, every other round in the opposite order; each turn's figures."""
    results = {row: {"shardtrain": [], "torch": []} for row in ROWS}
    turns = [(row, side) for row in ROWS for side in ("shardtrain", "torch")]
    for number in range(rounds):
        for row, side in turns if number % 2 == 0 else reversed(turns):
            turn = shardtrain.turn(row) if side == "shardtrain" else torch_turn(pool, config, row, delay)
            results[row][side].append(turn)
        print(f"round {number + 1}: " + "  ".join(
            f"{row} {statistics.median(results[row]['shardtrain'][-1]['times']) * 1e3:.0f}/"
            f"{statistics.median(results[row]['torch'][-1]['times']) * 1e3:.0f} ms" for row in ROWS), flush=True)
    return results


def parse(argv: list[str] | None) -> tuple[Config, argparse.Namespace]:
    """The run's Config (the defaults, or --quick's, with the options given) and the other options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per turn (default 10; --quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; --quick 1)")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default 32; --quick 8)")
    parser.add_argument("--microbatches", type=int, default=None, help="per step (default 8; --quick 4)")
    parser.add_argument("--simulate-compute-ms", type=float, default=0.0,
                        help="simulated device time per forward and per backward of a stage (see above)")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT (width 32, 8 tokens), for the test")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else Config()
    given = {"steps": args.steps, "warmup": args.warmup, "batch": args.batch, "microbatches": args.microbatches}
    config = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    if config.batch % (config.microbatches * 2) or config.microbatches % 4:
        parser.error("--microbatches must be a multiple of 4 (the stages) and --batch of 2 x --microbatches")
    return config, args


def main(argv: list[str] | None = None) -> None:
    """Starts both sides, runs the rounds, prints the table and the loss checks; exits non-zero if one failed."""
    config, args = parse(argv)
    started, load = time.perf_counter(), os.getloadavg()
    torch.set_num_threads(threads_for(4))
    with contextlib.ExitStack() as stack:
        pool = TorchPool(4)
        stack.callback(pool.close)
        pool.start()  # the ranks start up while the reference trains and the clusters start
        expected = {row: reference_losses(config, 2 if row == "dp" else config.microbatches) for row in ROWS}
        shardtrain = Shardtrain(config, args.simulate_compute_ms, stack)
        pool.ready()
        results = run_rounds(shardtrain, pool, config, args.rounds, args.simulate_compute_ms / 1e3)
    print(f"GPT of 8 blocks, width {config.width}, {config.heads} heads, {config.seq} tokens, vocabulary "
          f"{config.vocab}; batch {config.batch}, {config.microbatches} micro-batches over 4 stages "
          f"(data parallel: 2 replicas of the whole model, {config.batch // 2} rows each); SGD lr {config.lr}; "
          f"{args.rounds} rounds of {config.warmup} + {config.steps} steps; simulated compute "
          f"{args.simulate_compute_ms:g} ms; {threads_for(4)} intra-op thread(s) per process")
    print_table(results, config.steps)
    print("torch: " + "; ".join(f"{row} {name}" for row, name in TORCH_NAMES.items()))
    failed = check_losses(results, expected)
    print(f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after; {os.cpu_count()} cores; "
          f"{time.perf_counter() - started:.0f} s in all")
    if failed:
        raise SystemExit(f"loss checks FAILED: {'; '.join(failed)}")
    print("loss checks: all passed")


if __name__ == "__main__":
    main()
