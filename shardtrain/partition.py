"""Where to cut a layer list into contiguous stages: a pure function of layer costs."""

from __future__ import annotations

from collections.abc import Sequence

from shardtrain.errors import InvalidArgument, ResourceExhausted

Ranges = list[tuple[int, int]]  # (first layer, end layer exclusive) per stage


def balanced(costs: Sequence, num_stages: int, memory: Sequence = (), capacities: Sequence[int] = ()) -> Ranges:
    """Contiguous stages minimising the largest stage cost; ties cut as early as possible. `costs` (and `memory`)
    hold one value per layer, or one row of them per stage: what each layer costs on that stage's shard. With
    `memory` and `capacities` (per stage, 0: unlimited), only stages that fit their shard are considered."""
    layers = len(costs[0]) if _per_stage(costs) else len(costs)
    _check_count(layers, num_stages)
    prices = [_prefix(row) for row in rows(costs, num_stages)]
    held = [_prefix(row) for row in rows(memory or [0] * layers, num_stages)]
    limits = list(capacities) or [0] * num_stages
    # best[k][i]: the smallest possible largest-stage cost for layers[:i] in k stages.
    inf = float("inf")
    best = [[inf] * (layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        price, hold, limit = prices[k - 1], held[k - 1], limits[k - 1]
        for i in range(k, layers + 1):
            for j in range(k - 1, i):
                if limit and hold[i] - hold[j] > limit:
                    continue
                candidate = max(best[k - 1][j], price[i] - price[j])
                if candidate < best[k][i]:
                    best[k][i], cut[k][i] = candidate, j
    if best[num_stages][layers] == inf:
        raise ResourceExhausted(_does_not_fit(_largest(memory, num_stages), capacities))
    return _walk_back(cut, num_stages, layers)


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


def _prefix(values: Sequence[int]) -> list[int]:
    sums = [0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


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


def _walk_back(cut: list[list[int]], num_stages: int, num_layers: int) -> Ranges:
    ranges, end = [], num_layers
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


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
