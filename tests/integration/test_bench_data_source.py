"""bench/data_source.py: an epoch fed both ways (the shards reading, the client sending), and the rates compared."""

from __future__ import annotations

import re
import subprocess
import sys

from bench import ab


def test_both_ways_are_timed_and_compared():
    run = subprocess.run([sys.executable, "-m", "bench.data_source", "--rows", "256", "--features", "64",
                          "--batch", "64", "--rounds", "1"], cwd=ab.ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "256 rows x 64 features (0 MiB), batches of 64, 2 replicas of 2 stages" in run.stdout
    match = re.search(r"^samples/s: files (\d+), client (\d+), ratio files/client ([\d.]+)x", run.stdout, re.M)
    assert match, run.stdout
    files, client, ratio = (float(group) for group in match.groups())
    assert files > 0 and client > 0 and abs(ratio - files / client) <= 0.01 + 0.05 * ratio  # printed rounded
