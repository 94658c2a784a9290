"""Residuals (saved tensors used by later layers): how a layer chain runs them, and who sends what to whom."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardtrain.errors import InvalidArgument

OUTPUT = "@output"  # the FetchTensor name of the last stage's output; "@" keeps it apart from residual names
INPUT_GRADIENT = "@input_grad"  # the FetchTensor name of the first stage's input gradient, when asked for
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class Wiring:
    """Which saved tensors a layer takes after its main input, and which extra outputs it saves."""

    dependencies: tuple[str, ...] = ()
    out_variables: tuple[str, ...] = ()


@dataclass
class StageResiduals:
    """For one stage: residuals it fetches (name -> producer stage) and produces (name -> consumer stages)."""

    incoming: dict[str, int] = field(default_factory=dict)
    outgoing: dict[str, list[int]] = field(default_factory=dict)


def check_wiring(wirings: Sequence[Wiring]) -> dict[str, int]:
    """Validates names and order; returns each residual's producing layer."""
    producer: dict[str, int] = {}
    for index, wiring in enumerate(wirings):
        for name in wiring.dependencies:
            if name not in producer:
                raise InvalidArgument(f"layer {index} depends on {name!r}, which no earlier layer saves "
                                      f"(saved so far: {sorted(producer)})")
        for name in wiring.out_variables:
            if not _NAME.fullmatch(name):
                raise InvalidArgument(f"layer {index}: residual name {name!r} must be a plain identifier")
            if name in producer:
                raise InvalidArgument(f"layer {index} saves {name!r}, already saved by layer {producer[name]}")
            producer[name] = index
    return producer


def route(wirings: Sequence[Wiring], ranges: Sequence[tuple[int, int]]) -> list[StageResiduals]:
    """Which residuals cross which stage boundaries, for a given partition."""
    producer_layer = check_wiring(wirings)
    stage_of = {layer: stage for stage, (start, end) in enumerate(ranges) for layer in range(start, end)}
    routes = [StageResiduals() for _ in ranges]
    for layer, wiring in enumerate(wirings):
        for name in wiring.dependencies:
            source, sink = stage_of[producer_layer[name]], stage_of[layer]
            if source == sink or name in routes[sink].incoming:
                continue
            routes[sink].incoming[name] = source
            routes[source].outgoing.setdefault(name, []).append(sink)
    return routes


def run_chain(layers: Sequence[torch.nn.Module], wirings: Sequence[Wiring], x: torch.Tensor,
              saved: dict[str, torch.Tensor]) -> torch.Tensor:
    """Runs layers in order, passing dependencies from `saved` and adding what each layer saves to it."""
    for layer, wiring in zip(layers, wirings):
        result = layer(x, *(saved[name] for name in wiring.dependencies))
        if wiring.out_variables:
            x, *extra = result
            saved.update(zip(wiring.out_variables, extra))
        else:
            x = result
    return x
