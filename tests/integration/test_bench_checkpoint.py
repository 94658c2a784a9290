"""bench/checkpoint.py: a checkpoint saved and loaded both ways, and the two times compared."""

from __future__ import annotations

import re
import subprocess
import sys

from bench import ab


def test_both_ways_are_timed_and_compared():
    run = subprocess.run([sys.executable, "-m", "bench.checkpoint", "--stages", "2", "--stage-mb", "4",
                          "--rounds", "1"], cwd=ab.ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "2 stages x 4 MiB of weights, with Adam: 24 MiB per checkpoint" in run.stdout
    for what in ("save", "load"):
        match = re.search(rf"^{what}: shards ([\d.]+) s, client ([\d.]+) s, ratio shards/client ([\d.]+)x",
                          run.stdout, re.M)
        assert match, run.stdout
        shards, client, ratio = (float(group) for group in match.groups())
        assert shards > 0 and client > 0 and abs(ratio - shards / client) <= 0.01 + 0.1 * ratio  # printed rounded
