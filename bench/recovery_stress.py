"""Stress of recovery: shards killed at random moments of a train_step, each run's final weights against one process.

    python -m bench.recovery_stress [--kills 50] [--seed 0] [--replicas 2]

Each run deploys a small model (replicas=2 of two stages, with a spare; or, with --replicas 1, three stages with
snapshot_every=2 and a spare), trains a few steps with a learning rate that changes every step, and during one
of them sends one shard SIGKILL, or SIGSTOP held past the peer deadline (short here) until a spare took its
place, then SIGCONT: back, it holds only the old deployment. The victims take every stage position and both
signals in turn; the moment within the step is random. Every run must end within TOLERANCE of the same training
in one process: a call whose train_step raised is counted as lost and made again, a roll-back (RolledBack) trains
again from where it says. A run that ends elsewhere prints its seed, position, signal and moment, and
`python -m bench.recovery_stress --kills 1 --seed S` runs that one again.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from client_sdk import Cluster
from shardtrain import errors
from shardtrain.settings import Timeouts

log = logging.getLogger("bench.recovery_stress")
TOLERANCE = 1e-5
STEPS = 6
LR = 0.01
# Short deadlines, so that a stopped shard is given up on within seconds; long enough for a loaded CI machine.
TIMEOUTS = Timeouts(rpc=4.0, peer_wait=4.0, probe=1.0)
SIMULATED_MS = 20  # per forward and backward: a step long enough for a moment within it to mean something
SIGNALS = (signal.SIGKILL, signal.SIGSTOP)


@dataclass(frozen=True)
class Kill:
    """One run's victim and moment: the shard of (replica, stage), `signal` during train_step call `step`,
    `fraction` of a step's duration into it (past 1: just after it)."""

    seed: int
    replica: int
    stage: int
    signal: int
    step: int
    fraction: float

    def __str__(self) -> str:
        return (f"seed {self.seed}: {signal.Signals(self.signal).name} of replica {self.replica} stage {self.stage} "
                f"{self.fraction:.2f} of a step into call {self.step}")


@dataclass(frozen=True)
class Outcome:
    """How one run ended: its weights' largest difference from one process's, and what the SDK did."""

    kill: Kill
    difference: float
    recoveries: int
    steps_run_again: int
    lost_and_retried: int  # train_step calls that raised and were made again
    rolled_back: int
    seconds: float  # the whole run: deploy, training through the kill, the spare started for the next

    @property
    def exact(self) -> bool:
        return self.difference <= TOLERANCE


def kills(count: int, seed: int, replicas: int, stages: int) -> list[Kill]:
    """`count` kills, each at a random moment of a random call (seeded by its own number, so that one of them runs
    again alone). From seed 0, the first of them take every (replica, stage) position once with the signals taking
    turns, the next as many the other signal at each: every position and signal in twice that many."""
    positions = [(r, s) for r in range(replicas) for s in range(stages)]
    plans = []
    for number in range(seed, seed + count):
        replica, stage = positions[number % len(positions)]
        sig = SIGNALS[(number % len(positions) + number // len(positions)) % 2]
        rng = random.Random(number)
        plans.append(Kill(number, replica, stage, sig, rng.randrange(1, STEPS - 1), rng.uniform(0.0, 1.2)))
    return plans


def reference_model() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(20, 4, generator=generator), torch.randn(20, 1, generator=generator))
            for _ in range(STEPS)]


def rate(index: int) -> float:
    """The learning rate of call `index`: a call trained again must apply the one of its time."""
    return LR / (1 + index)


def trained_locally(data) -> dict[str, torch.Tensor]:
    local = copy.deepcopy(reference_model())
    optimizer = torch.optim.Adam(local.parameters(), lr=LR)
    for index, (x, y) in enumerate(data):
        optimizer.param_groups[0]["lr"] = rate(index)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(local(x), y).backward()
        optimizer.step()
    return local.state_dict()


class Stress:
    """One cluster on which runs follow one another, a new spare started after each."""

    def __init__(self, replicas: int = 2):
        self.replicas = replicas
        self.stages = 2 if replicas > 1 else 3
        with _simulated():
            self.cluster = Cluster.local(num_shards=self.replicas * self.stages, spares=1, timeouts=TIMEOUTS)
        self.data = batches()
        self.expected = trained_locally(self.data)

    def close(self) -> None:
        logs = self.cluster._services.log_dir
        self.cluster.close()
        shutil.rmtree(logs, ignore_errors=True)  # kept by close() because shards died: here on purpose

    def run(self, kill: Kill) -> Outcome:
        """Trains with `kill`; the victim is gone afterwards and a new spare waits."""
        model = self.cluster.deploy(reference_model(), optimizer=(torch.optim.Adam, {"lr": LR}),
                                    num_stages=self.stages, replicas=self.replicas,
                                    snapshot_every=0 if self.replicas > 1 else 2)
        victim, started = self._victim(model, kill), time.monotonic()
        try:
            lost, rolled = self._train(model, victim)
            difference = _largest_difference(model.state_dict(), self.expected)
            recoveries = list(model.recoveries)
        finally:
            victim.end()
            model.close()
            with _simulated():
                self.cluster._services.add_shard()  # the next run's spare
        return Outcome(kill, difference, len(recoveries), sum(r.steps_run_again for r in recoveries), lost, rolled,
                       time.monotonic() - started)

    def _victim(self, model, kill: Kill) -> Victim:
        clients = model._trainer.replicas[kill.replica] if self.replicas > 1 else model._clients
        address = clients.stages[kill.stage].address
        # The live one: a shard started later may have the address of one that died.
        services = self.cluster._services.services
        return Victim(next(s for s in services if s.address == address and s.process.poll() is None), kill)

    def _train(self, model, victim: Victim) -> tuple[int, int]:
        """Trains every batch once, through the kill; returns (calls lost and made again, roll-backs)."""
        index, lost, rolled, step_seconds = 0, 0, 0, 0.5
        while index < len(self.data):
            if index == victim.kill.step:
                victim.strike(victim.kill.fraction * step_seconds)
            model.optimizer.param_groups[0]["lr"] = rate(index)
            started = time.monotonic()
            try:
                model.train_step(*self.data[index], "MSELoss", microbatches=2)
            except errors.RolledBack as error:
                rolled, index = rolled + 1, error.resume_step
                continue
            except errors.ShardtrainError as error:
                lost += 1
                if lost > 3:
                    raise
                log.warning("%s: call %d lost, made again: %s", victim.kill, index, error)
                continue
            victim.resume_if_replaced(model)
            step_seconds = step_seconds if victim.struck else time.monotonic() - started
            index += 1
        model.synchronize()
        return lost, rolled


class Victim:
    """The shard a run kills or stops."""

    def __init__(self, service, kill: Kill):
        self.service, self.kill = service, kill
        self.struck = self.resumed = False

    def strike(self, after_seconds: float) -> None:
        """Sends the kill's signal `after_seconds` from now (once)."""
        if not self.struck:
            self.struck = True
            threading.Timer(after_seconds, os.kill, (self.service.process.pid, self.kill.signal)).start()

    def resume_if_replaced(self, model) -> None:
        """A stopped victim goes on once a spare took its place, as a paused machine would: it holds only the old
        deployment, whose work must not reach the new one."""
        if self.kill.signal == signal.SIGSTOP and model.recoveries and not self.resumed:
            self.resumed = True
            os.kill(self.service.process.pid, signal.SIGCONT)

    def end(self) -> None:
        """Gone for good, so that no later run meets it."""
        process = self.service.process
        if process.poll() is None:
            process.kill()
        process.wait()


@contextlib.contextmanager
def _simulated():
    """Shards started meanwhile take SIMULATED_MS per forward and backward (they read it as they start)."""
    os.environ["SHARDTRAIN_SIMULATE_COMPUTE_MS"] = str(SIMULATED_MS)
    try:
        yield
    finally:
        del os.environ["SHARDTRAIN_SIMULATE_COMPUTE_MS"]


def _printed(line: str) -> None:
    print(line, flush=True)


def _largest_difference(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((ours[key] - value).abs().max().item() for key, value in expected.items())


def stress(count: int, seed: int = 0, replicas: int = 2, report=_printed) -> list[Outcome]:
    """Runs `count` kills on one cluster; reports each outcome as it ends."""
    runner = Stress(replicas)
    outcomes = []
    try:
        for kill in kills(count, seed, replicas, runner.stages):
            outcome = runner.run(kill)
            outcomes.append(outcome)
            report(f"{'exact' if outcome.exact else 'DIFFERENT'} {outcome.difference:.2e}  {kill}  "
                   f"(recoveries {outcome.recoveries}, run again {outcome.steps_run_again}, "
                   f"lost and retried {outcome.lost_and_retried}, rolled back {outcome.rolled_back}; "
                   f"{outcome.seconds:.1f} s)")
    finally:
        runner.close()
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=50, help="runs, one shard killed or stopped in each")
    parser.add_argument("--seed", type=int, default=0, help="the first run's seed; the others follow it")
    parser.add_argument("--replicas", type=int, default=2, choices=(1, 2),
                        help="2: replicas of two stages; 1: three stages that roll back to snapshots")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    log.setLevel(logging.WARNING)  # each call lost and made again, with why
    outcomes = stress(args.kills, args.seed, args.replicas)
    different = [outcome for outcome in outcomes if not outcome.exact]
    print(f"{len(outcomes) - len(different)} of {len(outcomes)} runs exact (within {TOLERANCE:g})")
    if different:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
