"""bench/request_metrics.py runs its two servers, with and without the token check, and prints both ratios."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize("flags", [[], ["--no-token"]])
def test_the_benchmark_times_both_kinds_of_call_against_both_servers(flags):
    done = subprocess.run([sys.executable, "-m", "bench.request_metrics", "--exchanges", "200", "--rounds", "2",
                           *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ratio = r"x(\d+\.\d{3}|nan)"  # CPU is read in clock ticks: a short round may have none to compare
    for way in ("unary call", "client-streaming call"):
        assert re.search(rf"{way} +median round trip .* latency {ratio} .* server CPU {ratio}", done.stdout), done.stdout
