"""shardtrain.partition: where a layer list is cut into stages, against written-out tables."""

from __future__ import annotations

import itertools
import random
import re
import time

import pytest

from shardtrain.errors import InvalidArgument, ResourceExhausted
from shardtrain.partition import at_split_points, balanced, by_counts, plan

# Parameter counts of client_sdk.seed_models.TEST_RESIDUAL_SMALL, layer by layer.
SEED_COSTS = [1024, 0, 262656, 0, 262656, 0, 262656, 0, 513, 0]

BALANCED = [
    # costs, stages, expected ranges
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),
    ([1, 1, 1, 1], 1, [(0, 4)]),
    ([1, 1, 1, 1], 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ([5], 1, [(0, 1)]),
    ([4, 1, 1, 1, 1], 2, [(0, 1), (1, 5)]),
    ([1, 1, 1, 1, 4], 2, [(0, 4), (4, 5)]),
    ([1, 1, 1, 1, 1], 3, [(0, 1), (1, 3), (3, 5)]),   # ties: the earliest cuts
    ([0, 0, 0], 2, [(0, 1), (1, 3)]),                  # all free: first stage as small as possible
    ([3, 3, 3, 9], 2, [(0, 3), (3, 4)]),
    (SEED_COSTS, 3, [(0, 3), (3, 5), (5, 10)]),
    (SEED_COSTS, 2, [(0, 3), (3, 10)]),       # 263680 | 525825 beats 526336 | 263169
]


@pytest.mark.parametrize(("costs", "stages", "expected"), BALANCED)
def test_balanced(costs, stages, expected):
    assert balanced(costs, stages) == expected


def all_partitions(num_layers: int, num_stages: int):
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = [0, *cuts, num_layers]
        yield list(zip(bounds[:-1], bounds[1:]))


def largest(costs, ranges) -> int:
    return max(sum(costs[start:end]) for start, end in ranges)


@pytest.mark.parametrize("costs", [[7, 2, 5, 1, 9, 3], [1, 8, 1, 8, 1], [0, 4, 0, 4, 0, 4], [2, 2, 2, 2, 2, 2]])
def test_balanced_is_optimal_and_picks_the_earliest_cuts_among_ties(costs):
    for stages in range(1, len(costs) + 1):
        candidates = list(all_partitions(len(costs), stages))
        best = min(largest(costs, r) for r in candidates)
        earliest = min(r for r in candidates if largest(costs, r) == best)
        assert balanced(costs, stages) == earliest, (costs, stages)


def test_balanced_with_more_stages_than_layers_names_both_counts():
    with pytest.raises(InvalidArgument, match="cannot cut 2 layers into 3 non-empty stages"):
        balanced([1, 1], 3)


@pytest.mark.parametrize("stages", [0, -1])
def test_balanced_needs_at_least_one_stage(stages):
    with pytest.raises(InvalidArgument, match=f"need at least one stage, got {stages}"):
        balanced([1, 1], stages)


SPLIT_POINTS = [
    (4, [2], [(0, 2), (2, 4)]),
    (4, [1, 2, 3], [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (4, [], [(0, 4)]),
    (10, [3, 5], [(0, 3), (3, 5), (5, 10)]),
]


@pytest.mark.parametrize(("num_layers", "points", "expected"), SPLIT_POINTS)
def test_at_split_points(num_layers, points, expected):
    assert at_split_points(num_layers, points) == expected


@pytest.mark.parametrize("points", [[0], [4], [5], [2, 2], [3, 1], [-1], [1, 4]])
def test_bad_split_points_are_named(points):
    with pytest.raises(InvalidArgument,
                       match=re.escape(f"split points {points} must be increasing layer indexes in 1..3")):
        at_split_points(4, points)


COUNTS = [
    (4, [2, 2], [(0, 2), (2, 4)]),
    (4, [4], [(0, 4)]),
    (10, [3, 2, 5], [(0, 3), (3, 5), (5, 10)]),
    (3, [1, 1, 1], [(0, 1), (1, 2), (2, 3)]),
]


@pytest.mark.parametrize(("num_layers", "counts", "expected"), COUNTS)
def test_by_counts(num_layers, counts, expected):
    assert by_counts(num_layers, counts) == expected


@pytest.mark.parametrize("counts", [[2, 1], [2, 3], [4, 0], [5, -1], []])
def test_counts_that_do_not_add_up_are_named(counts):
    with pytest.raises(InvalidArgument,
                       match=re.escape(f"layers per stage {counts} must be positive and add up to 4 layers")):
        by_counts(4, counts)


# plan(): which of the three ways a deploy asked for.

def test_plan_without_explicit_cuts_balances_costs():
    assert plan(SEED_COSTS, 3) == [(0, 3), (3, 5), (5, 10)]


def test_plan_uses_split_points_over_costs():
    assert plan(SEED_COSTS, 3, split_points=[2, 8]) == [(0, 2), (2, 8), (8, 10)]


def test_plan_uses_layers_per_stage_over_costs():
    assert plan(SEED_COSTS, 3, layers_per_stage=[1, 1, 8]) == [(0, 1), (1, 2), (2, 10)]


def test_plan_may_use_fewer_stages_than_shards():
    assert plan([1, 1, 1], 5, split_points=[1]) == [(0, 1), (1, 3)]


def test_plan_refuses_split_points_and_counts_together():
    with pytest.raises(InvalidArgument, match="split points or layers per stage, not both"):
        plan([1, 1, 1, 1], 2, split_points=[2], layers_per_stage=[2, 2])


def test_plan_refuses_more_split_stages_than_shards():
    with pytest.raises(InvalidArgument, match="3 stages asked for but only 2 shards"):
        plan([1, 1, 1, 1], 2, split_points=[1, 2])


def test_plan_refuses_more_counted_stages_than_shards():
    with pytest.raises(InvalidArgument, match="4 stages asked for but only 3 shards"):
        plan([1, 1, 1, 1], 3, layers_per_stage=[1, 1, 1, 1])


def test_plan_refuses_more_stages_than_layers():
    with pytest.raises(InvalidArgument, match="cannot cut 3 layers into 4"):
        plan([1, 1, 1], 4)


def test_plan_passes_on_bad_split_points():
    with pytest.raises(InvalidArgument, match=r"split points \[0, 2\]"):
        plan([1, 1, 1, 1], 4, split_points=[0, 2])


def test_plan_passes_on_counts_that_do_not_add_up():
    with pytest.raises(InvalidArgument, match=r"layers per stage \[1, 1\] must be positive and add up to 4"):
        plan([1, 1, 1, 1], 4, layers_per_stage=[1, 1])


# Memory: each stage within its shard's memory (0: unknown, unlimited).
@pytest.mark.parametrize("costs, memory, capacities, expected", [
    ([1, 1, 1, 1], [1, 1, 1, 1], [0, 0], [(0, 2), (2, 4)]),            # no limit: balanced by cost
    ([1, 1, 1, 1], [1, 1, 1, 1], [1, 3], [(0, 1), (1, 4)]),            # a small first shard takes less
    ([5, 1, 1, 1], [1, 1, 1, 4], [4, 4], [(0, 3), (3, 4)]),            # the heavy last layer alone on its shard
    ([4, 1, 1, 1], [3, 3, 3, 3], [6, 6], [(0, 2), (2, 4)]),            # the best cost among cuts that fit
])
def test_balanced_keeps_every_stage_within_its_shards_memory(costs, memory, capacities, expected):
    assert balanced(costs, len(capacities), memory, capacities) == expected


def test_a_model_that_fits_no_way_is_refused_with_the_numbers():
    mib = 2**20
    with pytest.raises(ResourceExhausted, match=r"the model needs 12 MiB in all .* its largest layer 5 MiB\) and the "
                                                r"2 shards have 4 MiB, 8 MiB: use more shards"):
        balanced([1, 1, 1], 2, [5 * mib, 4 * mib, 3 * mib], [4 * mib, 8 * mib])


def test_explicit_split_points_that_overfill_a_shard_are_refused():
    mib = 2**20
    with pytest.raises(ResourceExhausted, match=r"stage 1 \(layers 1-2\) needs 6 MiB and its shard has 4 MiB"):
        plan([1, 1, 1], 2, split_points=[1], memory=[mib, 3 * mib, 3 * mib], capacities=[8 * mib, 4 * mib])
    assert plan([1, 1, 1], 2, split_points=[2], memory=[mib, 3 * mib, 3 * mib],
                capacities=[8 * mib, 4 * mib]) == [(0, 2), (2, 3)]


@pytest.mark.parametrize("costs, expected", [
    # Eight equal layers: a shard twice as fast takes more of them; the same speed everywhere splits them evenly.
    ([[1] * 8, [2] * 8], [(0, 5), (5, 8)]),
    ([[2] * 8, [2] * 8], [(0, 4), (4, 8)]),
    ([[4] * 9, [2] * 9], [(0, 3), (3, 9)]),
    # A layer that is slow on the second shard only (an operation its device lacks) stays on the first.
    ([[1, 1, 1, 1], [1, 1, 1, 9]], [(0, 3), (3, 4)]),
])
def test_balanced_weighs_each_stage_by_what_its_own_shard_measured(costs, expected):
    assert balanced(costs, 2) == expected


def test_per_stage_memory_keeps_each_stage_within_its_own_shard():
    # The second shard saves twice the activations per layer (another device's kernels) and has room for 2 layers.
    assert balanced([[1] * 6, [1] * 6], 2, [[10] * 6, [20] * 6], [0, 40]) == [(0, 4), (4, 6)]
    with pytest.raises(ResourceExhausted, match=r"needs 0.0001144 MiB in all .*its largest layer 1.907e-05 MiB"):
        balanced([[1] * 6, [1] * 6], 2, [[10] * 6, [20] * 6], [30, 40])
    with pytest.raises(InvalidArgument, match="3 rows of layer costs for 2 stages"):
        balanced([[1] * 6] * 3, 2)


def test_balanced_stays_optimal_with_per_stage_costs_and_memory_limits_against_every_partition():
    generator = random.Random(7)
    for _ in range(200):
        layers, stages = generator.randint(1, 7), generator.randint(1, 4)
        if stages > layers:
            continue
        costs = [[generator.randint(0, 9) for _ in range(layers)] for _ in range(stages)]
        memory = [[generator.randint(0, 5) for _ in range(layers)] for _ in range(stages)]
        limits = [generator.choice([0, 6, 10]) for _ in range(stages)]
        fitting = [r for r in all_partitions(layers, stages)
                   if all(not limit or sum(memory[k][a:b]) <= limit for k, ((a, b), limit) in enumerate(zip(r, limits)))]
        if not fitting:
            with pytest.raises(ResourceExhausted):
                balanced(costs, stages, memory, limits)
            continue
        cost = lambda r: max(sum(costs[k][a:b]) for k, (a, b) in enumerate(r))  # noqa: E731
        best = min(cost(r) for r in fitting)
        assert balanced(costs, stages, memory, limits) == min(r for r in fitting if cost(r) == best)


def test_balancing_100000_layers_over_8_stages_takes_under_a_second():
    costs = [random.Random(1).randint(1, 1000) for _ in range(100_000)]
    start = time.process_time()
    ranges = balanced(costs, 8, [c * 10 for c in costs], [0] * 8)
    assert time.process_time() - start < 1.0
    assert ranges[0][0] == 0 and ranges[-1][1] == 100_000 and len(ranges) == 8
