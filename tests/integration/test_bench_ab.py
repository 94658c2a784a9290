"""bench/ab.py: revisions timed side by side, each on its own code, their worktrees gone afterwards."""

from __future__ import annotations

import math
import subprocess
from types import SimpleNamespace

from bench import ab


def worktrees() -> str:
    return subprocess.run(["git", "-C", str(ab.ROOT), "worktree", "list"], capture_output=True, text=True,
                          check=True).stdout


def test_two_revisions_train_in_alternating_rounds_and_leave_no_worktree(capsys):
    before = worktrees()
    ab.main(["--rounds", "2", "--steps", "10", "HEAD", "."])
    printed = capsys.readouterr().out
    assert "round 1: HEAD" in printed and "round 2: HEAD" in printed
    assert "per-round ratios to HEAD" in printed
    ratio_line = next(line for line in printed.splitlines() if line.strip().startswith(". "))
    assert "step time" in ratio_line and "faster in" in ratio_line and "of 2 rounds" in ratio_line
    assert worktrees() == before, "the worktree made for HEAD was removed"


def test_a_child_runs_the_code_of_its_own_tree(tmp_path):
    """The trap: with the package installed for development, shardtrain comes from this checkout unless the
    child's path names the worktree first (as a child started from the worktree alone would)."""
    tree = tmp_path / "tree"
    subprocess.run(["git", "-C", str(ab.ROOT), "worktree", "add", "--detach", "--quiet", str(tree), "HEAD"],
                   check=True)
    try:
        where = "import shardtrain, client_sdk, shard_service as s; print(shardtrain.__file__, client_sdk.__file__, " \
                "s.__file__)"
        found = subprocess.run([ab.sys.executable, "-c", where], cwd=tree, env=ab.child_env(tree),
                               capture_output=True, text=True, check=True).stdout.split()
    finally:
        subprocess.run(["git", "-C", str(ab.ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    assert all(path.startswith(str(tree)) for path in found), found


def test_paired_ratios_are_taken_round_by_round():
    base = SimpleNamespace(times=[1.0, 2.0, 1.0], cpu=[2.0, 2.0, 2.0])
    variant = SimpleNamespace(times=[0.9, 2.2, 0.8], cpu=[1.0, 2.0, 3.0])
    ratio = ab.paired(variant, base)
    assert ratio["time"] == 0.9 and ratio["time_range"] == (0.8, 1.1)
    assert ratio["cpu"] == 1.0 and ratio["cpu_range"] == (0.5, 1.5)
    assert (ratio["faster"], ratio["rounds"]) == (2, 3)


def test_rounds_too_short_to_count_cpu_give_no_cpu_ratio_instead_of_dividing_by_zero():
    base = SimpleNamespace(times=[1.0, 1.0], cpu=[0.0, 2.0])
    variant = SimpleNamespace(times=[0.9, 0.9], cpu=[1.0, 1.0])
    assert ab.paired(variant, base)["cpu"] == 0.5  # the round that counted none is left out
    assert math.isnan(ab.paired(variant, SimpleNamespace(times=[1.0, 1.0], cpu=[0.0, 0.0]))["cpu"])


def test_each_revision_runs_first_and_second_equally_often_in_every_place_of_a_clusters_life():
    places = {}  # (round within the cluster's life, revision) -> times it ran first
    for number in range(12):
        order = ab.running_order(["a", "b"], number, 2)
        places[(number % 2, order[0])] = places.get((number % 2, order[0]), 0) + 1
    assert places == {(0, "a"): 3, (0, "b"): 3, (1, "a"): 3, (1, "b"): 3}
