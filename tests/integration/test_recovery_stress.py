"""Recovery under many kills (bench/recovery_stress.py): a shard SIGKILLed, or SIGSTOPped past the peer deadline, at
a random moment of a train_step, and every run ends as one process trains, within 1e-5.

The suite runs a seeded subset: every (replica, stage) position of two replicas of two stages, and every stage of a
three-stage pipeline without replicas (snapshot_every=2: a roll-back) once each, the two signals taking turns.
For a change to recovery run more: RECOVERY_STRESS_KILLS=50 runs 50 of each shape (several minutes each), and
RECOVERY_STRESS_SEED=S starts from seed S. A failure names the seed of its run, and
`python -m bench.recovery_stress --kills 1 --seed S [--replicas 1]` runs that one again."""

from __future__ import annotations

import os

import pytest

from bench import recovery_stress

KILLS = int(os.environ.get("RECOVERY_STRESS_KILLS", "0"))
SEED = int(os.environ.get("RECOVERY_STRESS_SEED", "0"))


@pytest.mark.timeout(0 if KILLS else 300)
@pytest.mark.parametrize("replicas, positions", [(2, 4), (1, 3)])
def test_every_kill_ends_as_one_process_trains(replicas, positions):
    outcomes = recovery_stress.stress(KILLS or positions, SEED, replicas)
    different = [f"{outcome.kill}: {outcome.difference:.2e}" for outcome in outcomes if not outcome.exact]
    assert not different, "runs that ended elsewhere than one process: " + "; ".join(different)
    assert all(outcome.recoveries == 1 for outcome in outcomes)  # each kill was found, and replaced once
    kills = [outcome.kill for outcome in outcomes]
    assert len({(kill.replica, kill.stage) for kill in kills}) == min(len(kills), positions)
    assert len({kill.signal for kill in kills}) == min(len(kills), 2)
