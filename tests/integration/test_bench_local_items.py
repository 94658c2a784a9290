"""bench/local_items.py: tensor items on a same-host Link, inline against through a segment, between two processes."""

from __future__ import annotations

import subprocess
import sys

from bench import ab, local_items


def test_both_ways_echo_the_tensor_and_print_a_row_per_size():
    run = subprocess.run([sys.executable, "-m", "bench.local_items", "--sizes", "16K", "256K", "--exchanges", "5",
                          "--rounds", "1"], cwd=ab.ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if "x time" in line]
    assert [row.split("|")[0].strip() for row in rows] == ["16 KiB", "256 KiB"]


def test_a_round_too_short_to_count_cpu_gives_no_cpu_ratio():
    # /proc counts CPU in 10 ms ticks: a few exchanges of a small tensor can read as none at all.
    row = local_items.row_text(16 * 1024, (100e-6, 0.0), (90e-6, 0.0))
    assert row.endswith("0.90x time, n/a CPU")
    assert local_items.row_text(16 * 1024, (100e-6, 50e-6), (90e-6, 40e-6)).endswith("0.90x time, 0.80x CPU")
