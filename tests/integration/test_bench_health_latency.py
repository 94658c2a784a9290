"""bench/health_latency.py: a probe process times health and Describe answers in each phase of a small run."""

from __future__ import annotations

import re
import subprocess
import sys

from bench import ab


def test_every_phase_is_probed_and_the_slowest_answer_is_compared_with_the_budget():
    run = subprocess.run([sys.executable, "-m", "bench.health_latency", "--stage-mb", "4", "--steps", "1"],
                         cwd=ab.ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = {match[0]: [float(v) for v in match[2:]] for match in re.findall(
        r"^\s*(idle|deploy|train|checkpoint)\s+(\d+) \|\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) \|\s+([\d.]+)\s+([\d.]+)\s+"
        r"([\d.]+)$", run.stdout, re.M)}
    assert sorted(rows) == ["checkpoint", "deploy", "idle", "train"], run.stdout
    for median, p99, slowest, *describe in rows.values():
        assert 0 < median <= p99 <= slowest and 0 < describe[0] <= describe[2]
    slowest = max(row[2] for row in rows.values())
    ratio = re.search(rf"slowest health answer {slowest:.1f} ms: ([\d.]+)x the 100 ms budget", run.stdout)
    assert ratio and abs(float(ratio[1]) - slowest / 100) <= 0.006, run.stdout
