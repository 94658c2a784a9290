"""Which shard runs which layers, and how each stage reaches its neighbours and residual producers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.registry import ShardRecord
from shardtrain.residuals import StageResiduals


@dataclass(frozen=True)
class StagePlacement:
    """One stage as placed: its shard, its layers, its neighbours and its residual traffic."""

    stage: int
    shard: ShardRecord
    first_layer: int
    end_layer: int
    previous_address: str
    next_address: str
    incoming: dict[str, tuple[int, str]]   # residual -> (producer stage, producer address)
    outgoing: dict[str, list[int]]         # residual -> consumer stages
    consumers: dict[str, list[str]] = field(default_factory=dict)  # residual -> consumer addresses, same order


def place(ranges: Sequence[tuple[int, int]], routes: Sequence[StageResiduals],
          shards: Sequence[ShardRecord]) -> list[StagePlacement]:
    """Stage i goes to shards[i]; addresses are resolved so shards talk to each other directly."""
    addresses = [shard.address for shard in shards]
    placements = []
    for stage, ((first, end), route) in enumerate(zip(ranges, routes)):
        placements.append(StagePlacement(
            stage=stage, shard=shards[stage], first_layer=first, end_layer=end,
            previous_address=addresses[stage - 1] if stage > 0 else "",
            next_address=addresses[stage + 1] if stage + 1 < len(ranges) else "",
            incoming={name: (source, addresses[source]) for name, source in route.incoming.items()},
            outgoing=dict(route.outgoing),
            consumers={name: [addresses[c] for c in stages] for name, stages in route.outgoing.items()}))
    return placements
