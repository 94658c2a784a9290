"""bench/recovery.py: shards killed under a replicated deployment, each replaced, and the time it took printed."""

from __future__ import annotations

import subprocess
import sys

from bench import ab


def test_each_round_kills_a_shard_and_the_row_counts_its_recovery():
    run = subprocess.run([sys.executable, "-m", "bench.recovery", "--sizes-mb", "4", "--rounds", "2", "--steps", "1"],
                         cwd=ab.ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    [row] = [line for line in run.stdout.splitlines() if "MiB" in line and "each:" in line]
    fields = row.split()
    assert fields[:4] == ["4", "MiB", "12", "MiB"]  # one Linear(1024, 1024) per stage, and Adam's two moments
    assert row.count(" s") >= 4 and "12 MiB  (each:" in row  # the spare received the whole stage's state
