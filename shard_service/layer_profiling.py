"""Measures captured layers on this shard's device, for a deploy that balances stages by time: each layer's forward
and backward time and the activations autograd saves for them, on zero weights and inputs of the example's shapes.
Layers are built one at a time, so a model far larger than the shard can still be measured."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from shardtrain import wire
from shardtrain.capture import CapturedProgram
from shardtrain.errors import InvalidArgument
from shardtrain.saved_bytes import SavedBytes
from shardtrain.v1 import shard_pb2

REPEATS = 3       # timed runs per layer after one warm-up (the run that counts saved bytes); the median is kept
MAX_REPEATS = 20
LONG_RUN = 0.25   # seconds: a layer whose warm-up takes longer is timed once (its length evens out what repeats would)
MAX_LAYERS = 10_000  # layers in one request, as in a deploy
MAX_EXAMPLE_BYTES = 1 << 30  # the example inputs of one layer: a request cannot make a shard allocate more


def profile_layers(layers: Sequence[shard_pb2.CapturedLayer], repeats: int,
                   device: torch.device) -> list[shard_pb2.LayerProfile]:
    """Each layer's median forward-and-backward microseconds and saved activation bytes on `device`.

    Layers with the same program and example inputs (a model's identical blocks) are measured once: the
    measurement runs zero weights of the program's own shapes, so nothing else tells them apart."""
    if not 1 <= repeats <= MAX_REPEATS:
        raise InvalidArgument(f"repeats must be within 1..{MAX_REPEATS}, got {repeats}")
    measured: dict[tuple, shard_pb2.LayerProfile] = {}
    profiles = []
    for layer in layers:
        same = (layer.program, tuple(example.SerializeToString() for example in layer.example_inputs))
        if same not in measured:
            measured[same] = _profile(layer, repeats, device)
        profiles.append(measured[same])
    return profiles


def _profile(layer: shard_pb2.CapturedLayer, repeats: int, device: torch.device) -> shard_pb2.LayerProfile:
    program = CapturedProgram(layer.program)
    weights = {}
    for spec in program.state_specs():
        tensor = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        weights[spec.graph_key] = torch.nn.Parameter(tensor) if spec.is_parameter else tensor
    module = program.load(weights, device)
    args = _inputs(layer, program, device)
    with SavedBytes(weights.values()) as counter:
        warm_up = _forward_backward(module, args, list(weights.values()), device)
    repeats = 1 if warm_up > LONG_RUN else repeats  # a vocabulary's head, on a CPU: seconds a run, four shards
    runs = [_forward_backward(module, args, list(weights.values()), device) for _ in range(repeats)]
    return shard_pb2.LayerProfile(microseconds=max(1, round(statistics.median(runs) * 1e6)),
                                  activation_bytes=counter.total)


def _inputs(layer: shard_pb2.CapturedLayer, program: CapturedProgram, device: torch.device) -> list[torch.Tensor]:
    """Inputs of the example's shapes: random floats, zeros for integers (valid indexes), true for booleans."""
    specs = program.input_specs()
    if len(layer.example_inputs) != len(specs):
        raise InvalidArgument(f"layer {layer.index} takes {len(specs)} inputs; its example_inputs give "
                              f"{len(layer.example_inputs)}")
    tensors, total = [], 0
    for position, (example, spec) in enumerate(zip(layer.example_inputs, specs)):
        dtype, shape = wire.torch_dtype(example.dtype), tuple(example.shape)
        total += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if total > MAX_EXAMPLE_BYTES:
            raise InvalidArgument(f"layer {layer.index}: its example inputs exceed {MAX_EXAMPLE_BYTES >> 20} MiB")
        if dtype.is_floating_point:
            tensor = torch.randn(shape, dtype=dtype, device=device)
        elif dtype == torch.bool:
            tensor = torch.ones(shape, dtype=dtype, device=device)
        else:
            tensor = torch.zeros(shape, dtype=dtype, device=device)
        spec.check(tensor, f"layer {layer.index} example input {position}")
        tensors.append(tensor)
    return tensors


def _forward_backward(module: torch.nn.Module, args: list[torch.Tensor], weights: list[torch.Tensor],
                      device: torch.device) -> float:
    leaves = [arg.detach().requires_grad_(arg.is_floating_point()) for arg in args]
    wanted = [t for t in (*leaves, *weights) if t.requires_grad]
    _synchronize(device)
    start = time.perf_counter()
    with torch.enable_grad():
        result = module(*leaves)
        outputs = [t for t in (result if isinstance(result, (tuple, list)) else (result,))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs and wanted:
            torch.autograd.grad(outputs, wanted, [torch.ones_like(t) for t in outputs], allow_unused=True)
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
