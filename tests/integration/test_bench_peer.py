"""bench/peer.py: shardtrain and torch.distributed train the same GPT under every schedule and data parallel,
each equal to one process, and the table has a row for each."""

from __future__ import annotations

import re
import subprocess
import sys

from bench import ab, peer


def test_every_schedule_and_data_parallel_are_timed_both_ways_and_train_as_one_process():
    run = subprocess.run([sys.executable, "-m", "bench.peer", "--quick", "--rounds", "2"], cwd=ab.ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    number = r"(\d+\.\d+)"
    rows = {match[0]: [float(v) for v in match[1:]] for match in re.findall(
        rf"^\s*(\S.*?) \|\s+{number} \|\s+{number} \|\s+{number}x \|\s+{number} \|\s+{number}$", run.stdout, re.M)}
    assert sorted(rows) == sorted(["gpipe", "1f1b", "zb-h1", "interleaved", "dp 2x1"]), run.stdout
    for ours, theirs, ratio, our_cpu, their_cpu in rows.values():
        assert ours > 0 and theirs > 0 and abs(ratio - ours / theirs) <= 0.01 + 0.01 * ratio
        assert our_cpu > 0 and their_cpu > 0
    checks = re.findall(r"^loss check (\S+): .*: ok$", run.stdout, re.M)
    assert sorted(checks) == sorted(peer.ROWS), run.stdout
    assert "loss checks: all passed" in run.stdout
    assert "round 2:" in run.stdout


def test_a_loss_that_differs_from_one_process_fails_the_check(capsys):
    turn = {"losses": [1.0, 1.0 + 2 * peer.TOLERANCE]}
    results = {row: {"shardtrain": [turn], "torch": [{"losses": [1.0, 1.0]}]} for row in peer.ROWS}
    failed = peer.check_losses(results, {row: [1.0, 1.0] for row in peer.ROWS})
    assert [f.split()[:2] for f in failed] == [[row, "shardtrain"] for row in peer.ROWS]
    assert "FAILED" in capsys.readouterr().out
