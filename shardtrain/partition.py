"""Where to cut a layer list into contiguous stages: a pure function of layer costs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy

from shardtrain.errors import InvalidArgument, ResourceExhausted

Ranges = list[tuple[int, int]]  # (first layer, end layer exclusive) per stage


def balanced(costs: Sequence, num_stages: int, memory: Sequence = (), capacities: Sequence[int] = ()) -> Ranges:
    """Contiguous stages minimising the largest stage cost; ties cut as early as possible. `costs` (and `memory`)
    hold one value per layer, or one row of them per stage: what each layer costs on that stage's shard. With
    `memory` and `capacities` (per stage, 0: unlimited), only stages that fit their shard are considered.

    A binary search on the largest stage cost; each guess is checked stage by stage over every layer at once
    (numpy), so the work is O(stages x layers x log(total cost))."""
    layers = len(costs[0]) if _per_stage(costs) else len(costs)
    _check_count(layers, num_stages)
    fill = _Filling(rows(costs, num_stages), rows(memory or [0] * layers, num_stages),
                    list(capacities) or [0] * num_stages)
    high = int(max(price[-1] for price in fill.prices))
    if not fill.finishing(high)[0][0]:
        raise ResourceExhausted(_does_not_fit(_largest(memory, num_stages), capacities))
    low = 0
    while low < high:  # the smallest largest-stage cost that fits
        middle = (low + high) // 2
        low, high = (low, middle) if fill.finishing(middle)[0][0] else (middle + 1, high)
    return fill.earliest(low)


class _Filling:
    """Stages filled within a largest cost, from prefix sums of each stage's layer costs and memory."""

    def __init__(self, costs: list[Sequence[int]], memory: list[Sequence[int]], limits: list[int]):
        self.prices, self.held = [_cumulative(row) for row in costs], [_cumulative(row) for row in memory]
        self.limits, self.stages, self.layers = limits, len(costs), len(costs[0])

    def reach(self, stage: int, target: int) -> numpy.ndarray:
        """For every start s, the last end e (exclusive) stage `stage` can have from s within `target` and its
        memory (e == s: not even one layer)."""
        price, hold, limit = self.prices[stage], self.held[stage], self.limits[stage]
        ends = numpy.searchsorted(price, price + target, side="right") - 1
        if limit:
            ends = numpy.minimum(ends, numpy.searchsorted(hold, hold + limit, side="right") - 1)
        return ends

    def finishing(self, target: int) -> list[numpy.ndarray]:
        """finishing[k][s]: stages k.. can hold layers s.. within `target`, each at least one layer; with
        following[k][s], the first such start at or after s (layers + 1 where there is none)."""
        done = numpy.zeros(self.layers + 1, dtype=bool)
        done[self.layers] = True
        finishing = [done]
        for stage in range(self.stages - 1, -1, -1):
            after = _next_true(finishing[0])
            following = after[numpy.minimum(numpy.arange(self.layers + 1) + 1, self.layers)]  # an end after s
            following[self.layers] = self.layers + 1
            finishing.insert(0, following <= self.reach(stage, target))
        return finishing

    def earliest(self, target: int) -> Ranges:
        """The stages within `target` whose cuts come as early as possible, one after another."""
        finishing, ranges, start = self.finishing(target), [], 0
        for stage in range(self.stages):
            end = int(_next_true(finishing[stage + 1])[start + 1])  # the first end the later stages can go on from
            ranges.append((start, end))
            start = end
        return ranges


def _cumulative(row: Sequence[int]) -> numpy.ndarray:
    """0 and the running sums of a row of layer values."""
    return numpy.concatenate(([0], numpy.cumsum(numpy.asarray(row, dtype=numpy.int64))))


def _next_true(flags: numpy.ndarray) -> numpy.ndarray:
    """For each index, the first index at or after it whose flag is set (len(flags) where none is)."""
    positions = numpy.where(flags, numpy.arange(len(flags)), len(flags))
    return numpy.minimum.accumulate(positions[::-1])[::-1]


def _per_stage(values: Sequence) -> bool:
    return bool(values) and isinstance(values[0], (list, tuple))


def rows(values: Sequence, num_stages: int) -> list[Sequence[int]]:
    """One row of per-layer values per stage (the same row for each when `values` is one)."""
    if not _per_stage(values):
        return [values] * num_stages
    if len(values) != num_stages:
        raise InvalidArgument(f"{len(values)} rows of layer costs for {num_stages} stages")
    return list(values)


def _largest(memory: Sequence, num_stages: int) -> list[int]:
    """Each layer's memory on the shard where it needs the most."""
    per_stage = rows(memory, num_stages) if memory else []
    return [max(column) for column in zip(*per_stage)] if per_stage else []


def check_memory(ranges: Ranges, memory: Sequence, capacities: Sequence[int]) -> None:
    """ResourceExhausted, with the numbers, if a stage of given ranges needs more memory than its shard has
    (`memory`: per layer, or a row per stage)."""
    per_stage = rows(memory, len(ranges))
    for stage, ((start, end), limit) in enumerate(zip(ranges, capacities)):
        need = sum(per_stage[stage][start:end])
        if limit and need > limit:
            raise ResourceExhausted(f"stage {stage} (layers {start}-{end - 1}) needs {_gib(need)} and its shard has "
                                    f"{_gib(limit)}; {_does_not_fit(_largest(memory, len(ranges)), capacities)}")


def _does_not_fit(memory: Sequence[int], capacities: Sequence[int]) -> str:
    return (f"the model needs {_gib(sum(memory))} in all (weights, gradients, optimizer state and the example "
            f"batch's activations; its largest layer {_gib(max(memory, default=0))}) and the {len(capacities)} "
            f"shards have {', '.join(_gib(c) for c in capacities)}: use more shards, shards with more memory, or a "
            "smaller batch")


def _gib(size: int) -> str:
    return f"{size / 2**30:.4g} GiB" if size >= 2**30 else f"{size / 2**20:.4g} MiB"


def at_split_points(num_layers: int, split_points: Sequence[int]) -> Ranges:
    """Stages that start at each split point (layer index), the first at layer 0."""
    points = list(split_points)
    if points != sorted(set(points)) or not all(0 < p < num_layers for p in points):
        raise InvalidArgument(f"split points {points} must be increasing layer indexes in 1..{num_layers - 1}")
    bounds = [0, *points, num_layers]
    return list(zip(bounds[:-1], bounds[1:]))


def by_counts(num_layers: int, layers_per_stage: Sequence[int]) -> Ranges:
    """Stages of the given sizes, which must add up to the number of layers."""
    counts = list(layers_per_stage)
    if any(c < 1 for c in counts) or sum(counts) != num_layers:
        raise InvalidArgument(f"layers per stage {counts} must be positive and add up to {num_layers} layers")
    points, total = [], 0
    for count in counts[:-1]:
        total += count
        points.append(total)
    return at_split_points(num_layers, points)


def plan(costs: Sequence, num_stages: int, split_points: Sequence[int] = (),
         layers_per_stage: Sequence[int] = (), memory: Sequence = (), capacities: Sequence[int] = ()) -> Ranges:
    """The stages a deploy asks for: explicit split points, explicit counts, or balanced costs; each stage within
    its shard's memory when `memory` and `capacities` (per stage) are given. `costs` and `memory` hold a value per
    layer, or a row of them per stage (see balanced)."""
    if split_points and layers_per_stage:
        raise InvalidArgument("give split points or layers per stage, not both")
    layers = len(costs[0]) if _per_stage(costs) else len(costs)
    if split_points:
        ranges = at_split_points(layers, split_points)
    elif layers_per_stage:
        ranges = by_counts(layers, layers_per_stage)
    else:
        return balanced(costs, num_stages, memory, capacities[:num_stages])
    if len(ranges) > num_stages:
        raise InvalidArgument(f"{len(ranges)} stages asked for but only {num_stages} shards are available")
    if memory and capacities:
        check_memory(ranges, memory, capacities)
    return ranges


def _check_count(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise InvalidArgument(f"need at least one stage, got {num_stages}")
    if num_layers < num_stages:
        raise InvalidArgument(f"cannot cut {num_layers} layers into {num_stages} non-empty stages")
