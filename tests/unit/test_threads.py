"""shard_service.threads: each kind of stage work runs with the thread count that measured faster."""

from __future__ import annotations

import torch

from shard_service.threads import RETUNE, TRIALS, WARMUP, ThreadChoice, work_kind


def run(choice: ThreadChoice, kind: str, seconds_by_threads: dict[int, float], calls: int) -> list[int]:
    """Feeds `calls` pieces of work of `kind` that take the given time with each thread count."""
    used = []
    for _ in range(calls):
        threads = choice.threads(kind)
        used.append(threads)
        choice.record(kind, threads, seconds_by_threads[threads])
    return used


def test_trials_alternate_then_small_work_keeps_one_thread():
    choice = ThreadChoice(4)
    used = run(choice, "forward", {1: 0.001, 4: 0.003}, WARMUP + 2 * TRIALS + 5)
    trials = used[WARMUP:WARMUP + 2 * TRIALS]
    assert trials.count(1) == TRIALS and trials.count(4) == TRIALS
    assert used[WARMUP + 2 * TRIALS:] == [1] * 5
    assert choice.chosen() == {"forward": 1}


def test_big_work_takes_every_thread_and_kinds_are_tuned_apart():
    choice = ThreadChoice(2)
    run(choice, "backward", {1: 0.018, 2: 0.009}, WARMUP + 2 * TRIALS)
    run(choice, "step", {1: 0.003, 2: 0.004}, WARMUP + 2 * TRIALS)
    assert choice.chosen() == {"backward": 2, "step": 1}


def test_it_measures_again_after_retune_calls():
    choice = ThreadChoice(2)
    run(choice, "forward", {1: 0.001, 2: 0.002}, WARMUP + 2 * TRIALS + RETUNE)
    assert choice.chosen() == {}  # trying both again: the batch size may have changed
    run(choice, "forward", {1: 0.010, 2: 0.005}, 2 * TRIALS)  # no warm-up this time: the work is warm
    assert choice.chosen() == {"forward": 2}


def test_a_single_thread_shard_never_tries_more():
    choice = ThreadChoice(1)
    assert run(choice, "forward", {1: 0.5}, 10) == [1] * 10
    assert choice.chosen() == {}


def test_work_of_other_sizes_is_another_kind_tuned_apart():
    small, big = work_kind("forward", [(0, 0), torch.zeros(32, 512)]), work_kind("forward", [torch.zeros(1024, 512)])
    assert small == "forward of under 2^15 elements" and big == "forward of under 2^20 elements"
    assert work_kind("forward", [torch.zeros(40, 512)]) == small, "nearby sizes share a kind"
    assert work_kind("step", []) == "step"
    choice = ThreadChoice(2)
    run(choice, small, {1: 0.001, 2: 0.002}, WARMUP + 2 * TRIALS)
    run(choice, big, {1: 0.060, 2: 0.040}, WARMUP + 2 * TRIALS)
    assert choice.chosen() == {small: 1, big: 2}


def test_the_first_calls_of_a_kind_are_not_timed():
    """They allocate (an optimizer's state) and run slow: timed, they made Adam take two threads."""
    choice = ThreadChoice(2)
    for _ in range(WARMUP):  # seed-model Adam trials in a batch-32 run's shard logs: 3.9-13 ms; warm, about 1 ms
        choice.record("step", choice.threads("step"), 0.050)
    run(choice, "step", {1: 0.002, 2: 0.003}, 2 * TRIALS)
    assert choice.chosen() == {"step": 1}


def test_more_threads_must_save_a_tenth():
    choice = ThreadChoice(2)
    run(choice, "forward", {1: 0.0100, 2: 0.0095}, WARMUP + 2 * TRIALS)
    run(choice, "backward", {1: 0.0100, 2: 0.0085}, WARMUP + 2 * TRIALS)
    assert choice.chosen() == {"forward": 1, "backward": 2}
