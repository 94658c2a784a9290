"""Measured layer costs: each layer's forward and backward time on an example batch, for balancing stages by time."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from shardtrain.capture import LayerAdapter

REPEATS = 3  # timed runs per layer after one warm-up; the median is kept


def layer_times(layers: Sequence, x: torch.Tensor, inputs: dict[str, torch.Tensor] | None = None,
                repeats: int = REPEATS) -> list[float]:
    """Seconds of forward plus backward of each layer on the activations `x` (and the model's other `inputs`, by
    name) produce on the way through.

    Gradients are taken with torch.autograd.grad, so no parameter's .grad changes; the caller keeps the model's
    buffers and random stream (client_sdk.modes.untouched)."""
    saved = dict(inputs or {})
    times = []
    for layer in layers:
        adapter = LayerAdapter(layer.module, layer.wiring.out_variables).train()
        args = (x, *(saved[name] for name in layer.wiring.dependencies))
        runs = [_forward_backward(adapter, args) for _ in range(repeats + 1)][1:]
        times.append(statistics.median(runs))
        with torch.no_grad():
            result = adapter(*args)
        outputs = result if isinstance(result, tuple) else (result,)
        x = outputs[0]
        saved.update(zip(layer.wiring.out_variables, outputs[1:]))
    return times


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
