"""Which shard runs which layers, and how each stage reaches its neighbours and residual producers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.registry import ShardRecord
from shardtrain.residuals import CLIENT, StageResiduals


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
    tied: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # tied weight -> (stage, address) holding it


def tied_stages(ranges: Sequence[tuple[int, int]], tied_keys: Sequence[Sequence[str]]) -> list[dict[str, list[int]]]:
    """Per stage, the tied weights it shares with other stages and every stage holding each, from each layer's
    tied keys (StateEntry.tied_to)."""
    holders: dict[str, set[int]] = {}
    for stage, (first, end) in enumerate(ranges):
        for keys in tied_keys[first:end]:
            for key in keys:
                holders.setdefault(key, set()).add(stage)
    shared = {key: sorted(stages) for key, stages in holders.items() if len(stages) > 1}
    return [{key: stages for key, stages in shared.items() if stage in stages} for stage in range(len(ranges))]


def place(ranges: Sequence[tuple[int, int]], routes: Sequence[StageResiduals],
          shards: Sequence[ShardRecord], tied: Sequence[dict[str, list[int]]] = ()) -> list[StagePlacement]:
    """Stage i goes to shards[i]; addresses are resolved so shards talk to each other directly."""
    addresses = [shard.address for shard in shards]
    tied = tied or [{} for _ in ranges]
    placements = []
    for stage, ((first, end), route) in enumerate(zip(ranges, routes)):
        placements.append(StagePlacement(
            stage=stage, shard=shards[stage], first_layer=first, end_layer=end,
            previous_address=addresses[stage - 1] if stage > 0 else "",
            next_address=addresses[stage + 1] if stage + 1 < len(ranges) else "",
            incoming={name: (source, _address(addresses, source)) for name, source in route.incoming.items()},
            outgoing=dict(route.outgoing),
            consumers={name: [_address(addresses, c) for c in stages] for name, stages in route.outgoing.items()},
            tied={key: [(s, addresses[s]) for s in stages] for key, stages in tied[stage].items()}))
    return placements


def _address(addresses: Sequence[str], stage: int) -> str:
    return "" if stage == CLIENT else addresses[stage]
