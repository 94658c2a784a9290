"""Mixed precision: the dtype a stage computes in. Under "bf16" (or "fp16") every stage runs its layers under
autocast (matrix products in the half type, reductions and norms in float32, as torch.autocast chooses), keeps its
weights and the optimizer's state in float32, and sends activations and gradients to its neighbours in the half
type, half the bytes. fp16's narrow range needs loss scaling, which the client runs (client_sdk/loss_scaling.py).
"""

from __future__ import annotations

import contextlib

import torch

from shardtrain.errors import InvalidArgument

MODES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check(mode: str) -> str:
    """`mode` ("" as "fp32"); InvalidArgument naming the modes otherwise."""
    if mode not in ("", *MODES):
        raise InvalidArgument(f"precision must be one of {list(MODES)}, got {str(mode)[:40]!r}")
    return mode or "fp32"


def computing(mode: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Where a stage's layers run: under autocast to the mode's dtype, or as they are."""
    dtype = MODES[check(mode)]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def relax(module: torch.nn.Module) -> None:
    """Drops a captured graph's checks of the dtypes its tensors had at capture (aten._assert_tensor_metadata,
    which torch.export records for a .to() call): under autocast a matrix product's result is bfloat16 where
    the capture saw float32. They assert only; the casts themselves stay. The graphs a higher-order operator
    carries (a cond's branches) are relaxed too."""
    for graph_module in module.modules():
        graph = getattr(graph_module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        checks = [node for node in graph.nodes
                  if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default]
        for node in checks:
            graph.erase_node(node)
        if checks:
            graph_module.recompile()


def restored(value: torch.Tensor, mode: str) -> torch.Tensor:
    """A stage's output as the model declares it: autocast leaves a matrix product's result in the compute
    dtype, and the graph of the next stage (and the client) expects float32; the wire rounds it again anyway."""
    dtype = MODES[check(mode)]
    return value.float() if dtype is not None and value.dtype == dtype else value
