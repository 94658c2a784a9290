"""What the shards measure a layer on, for balancing stages by time: the shapes and dtypes of each layer's inputs
in the example batch, found with one forward through the layers (the shards time them on their own devices)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardtrain import wire
from shardtrain.capture import LayerAdapter
from shardtrain.residuals import passed_on
from shardtrain.v1 import shard_pb2


def example_inputs(layers: Sequence, x: torch.Tensor,
                   inputs: dict[str, torch.Tensor] | None = None) -> list[list[shard_pb2.TensorSpec]]:
    """Per layer, the specs of its inputs (main, then each dependency) as `x` and the model's other `inputs` (by name)
    produce them on the way through. The caller keeps the model's buffers and random stream
    (client_sdk.modes.untouched)."""
    saved = dict(inputs or {})
    specs = []
    with torch.no_grad():
        for layer in layers:
            adapter = LayerAdapter(layer.module, layer.wiring.out_variables).train()
            args = (x, *(saved[name] for name in layer.wiring.dependencies))
            specs.append([shard_pb2.TensorSpec(dtype=wire.dtype_code(t.dtype), shape=list(t.shape)) for t in args])
            x = passed_on(adapter(*args), layer.wiring, saved)
    return specs
