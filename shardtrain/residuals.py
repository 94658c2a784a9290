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
CLIENT = -1  # the SDK as a residual's producer (a model's input after the first) or consumer (an output after it)


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


def check_wiring(wirings: Sequence[Wiring], inputs: Sequence[str] = ()) -> dict[str, int]:
    """Validates names and order; returns each residual's producing layer (a model input's: layer 0, whose stage
    receives it from the SDK and passes it on)."""
    producer: dict[str, int] = {}
    for name in inputs:
        _check_name(name, "model input")
        producer[name] = 0
    for index, wiring in enumerate(wirings):
        for name in wiring.dependencies:
            if name not in producer:
                raise InvalidArgument(f"layer {index} depends on {name!r}, which no earlier layer saves "
                                      f"(saved so far: {sorted(producer)})")
        for name in wiring.out_variables:
            _check_name(name, f"layer {index}: residual")
            if name in producer:
                raise InvalidArgument(f"layer {index} saves {name!r}, already saved by layer {producer[name]}")
            producer[name] = index
    return producer


def _check_name(name: str, what: str) -> None:
    if not _NAME.fullmatch(name):
        raise InvalidArgument(f"{what} name {name!r} must be a plain identifier")


def route(wirings: Sequence[Wiring], ranges: Sequence[tuple[int, int]], inputs: Sequence[str] = (),
          outputs: Sequence[str] = ()) -> list[StageResiduals]:
    """Which residuals cross which stage boundaries, for a given partition: the model's extra inputs come into the
    first stage from the SDK, its extra outputs (saved by the last layer) go from the last stage to the SDK."""
    producer_layer = check_wiring(wirings, inputs)
    stage_of = {layer: stage for stage, (start, end) in enumerate(ranges) for layer in range(start, end)}
    routes = [StageResiduals() for _ in ranges]
    for name in inputs:
        routes[0].incoming[name] = CLIENT
    for layer, wiring in enumerate(wirings):
        for name in wiring.dependencies:
            source, sink = stage_of[producer_layer[name]], stage_of[layer]
            if source == sink or name in routes[sink].incoming:
                continue
            routes[sink].incoming[name] = source
            routes[source].outgoing.setdefault(name, []).append(sink)
    for name in outputs:
        if producer_layer.get(name) != len(wirings) - 1 or name in inputs:
            raise InvalidArgument(f"model output {name!r} must be saved by the last layer "
                                  f"({len(wirings) - 1}), not by layer {producer_layer.get(name)}")
        routes[-1].outgoing.setdefault(name, []).append(CLIENT)
    return routes


def run_chain(layers: Sequence[torch.nn.Module], wirings: Sequence[Wiring], x: torch.Tensor,
              saved: dict[str, torch.Tensor]) -> torch.Tensor:
    """Runs layers in order, passing dependencies from `saved` and adding what each layer saves to it."""
    for layer, wiring in zip(layers, wirings):
        x = passed_on(layer(x, *(saved[name] for name in wiring.dependencies)), wiring, saved)
    return x


def passed_on(result, wiring: Wiring, saved: dict[str, torch.Tensor]) -> torch.Tensor:
    """A layer's main output, from what it returned; what it saves goes into `saved` under its names."""
    if not wiring.out_variables:
        return result
    x, *extra = result
    saved.update(zip(wiring.out_variables, extra))
    return x
