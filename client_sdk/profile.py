"""Measured layer costs: each layer's forward and backward time and saved activations on an example batch, for
balancing stages by time and keeping each within its shard's memory."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardtrain.capture import LayerAdapter
from shardtrain.residuals import passed_on
from shardtrain.saved import SavedBytes

REPEATS = 3  # timed runs per layer after one warm-up (the run that counts saved bytes); the median is kept


@dataclass(frozen=True)
class LayerCost:
    """What one layer took on the example: forward plus backward seconds, and the bytes autograd saved."""

    seconds: float
    activation_bytes: int


def layer_costs(layers: Sequence, x: torch.Tensor, inputs: dict[str, torch.Tensor] | None = None,
                repeats: int = REPEATS) -> list[LayerCost]:
    """Each layer's cost on the activations `x` (and the model's other `inputs`, by name) produce on the way through.

    Gradients are taken with torch.autograd.grad, so no parameter's .grad changes; the caller keeps the model's
    buffers and random stream (client_sdk.modes.untouched)."""
    saved = dict(inputs or {})
    costs = []
    for layer in layers:
        adapter = LayerAdapter(layer.module, layer.wiring.out_variables).train()
        args = (x, *(saved[name] for name in layer.wiring.dependencies))
        activation_bytes = _saved_bytes(adapter, args)
        runs = [_forward_backward(adapter, args) for _ in range(repeats)]
        costs.append(LayerCost(statistics.median(runs), activation_bytes))
        with torch.no_grad():
            x = passed_on(adapter(*args), layer.wiring, saved)
    return costs


def _saved_bytes(adapter: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the tensors autograd saves for backward, weights aside (also a warm-up run)."""
    with SavedBytes(adapter.state_dict().values()) as counter:
        _forward_backward(adapter, args)
    return counter.total


def _forward_backward(adapter: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> float:
    leaves = [arg.detach().requires_grad_(arg.is_floating_point()) for arg in args]
    weights = [p for p in adapter.parameters() if p.requires_grad]
    start = time.perf_counter()
    with torch.enable_grad():
        result = adapter(*leaves)
        outputs = [t for t in (result if isinstance(result, tuple) else (result,)) if t.requires_grad]
        wanted = [t for t in (*leaves, *weights) if t.requires_grad]
        if outputs and wanted:
            torch.autograd.grad(outputs, wanted, [torch.ones_like(t) for t in outputs], allow_unused=True)
    return time.perf_counter() - start
