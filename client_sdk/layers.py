"""Turns what a user deploys (nn.Sequential, a seed layer list, a LayerList) into captured layers."""

from __future__ import annotations

import collections
import inspect
import json
import os
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from client_sdk import frozen, profile_inputs, whole_model_cuts
from client_sdk.interface import Interface
from client_sdk.layer_list import LayerList
from client_sdk.modes import ModeReads, untouched
from shardtrain.capture import CapturedProgram, LayerAdapter, capture_layer
from shardtrain.errors import InvalidArgument
from shardtrain.residuals import Wiring, passed_on
from shardtrain.v1 import shard_pb2

EXAMPLE_BATCH = 2  # a dynamic batch dimension needs an example of at least 2 rows (1 would be specialised)


@dataclass(frozen=True)
class Layer:
    """One layer of the user's model: the module, its wiring and its state-dict prefix."""

    module: torch.nn.Module
    wiring: Wiring
    prefix: str
    name: str = ""                              # what split points call it (default: the prefix)
    description: str = ""                       # one line for model.placements (default: the module's repr)
    eval_module: torch.nn.Module | None = None  # its eval-mode graph, for a unit of a whole-model capture
    varying: tuple[tuple[int, ...], ...] | None = None  # per input, the dims that vary (default: the batch)
    constants: tuple[tuple[str, torch.Tensor], ...] = ()  # tensors its forward makes, held as buffers, by key
    keys: tuple[tuple[str, str], ...] = ()  # a unit's weights' names in it -> their model keys, where they differ

    @property
    def cost(self) -> int:
        """Parameter count, the partitioner's measure of a layer."""
        return sum(p.numel() for p in self.module.parameters())


def as_module(model) -> torch.nn.Module:
    """The user's model as a local module: a seed layer list becomes a LayerList."""
    if isinstance(model, (list, tuple)):
        return LayerList(model)
    if isinstance(model, torch.nn.Module):
        return model
    raise InvalidArgument(f"cannot deploy a {type(model).__name__}; pass an nn.Sequential, a LayerList "
                          "or a seed layer list [(layer_class, kwargs, input_shape), ...]")


def is_layered(module: torch.nn.Module) -> bool:
    """True for the models deployed layer by layer (an nn.Sequential, a LayerList); others are captured whole."""
    return isinstance(module, (LayerList, torch.nn.Sequential))


def layers_of(module: torch.nn.Module) -> list[Layer]:
    """The layers, in order, of an nn.Sequential or a LayerList."""
    if isinstance(module, LayerList):
        return [Layer(m, w, name) for (name, m), w in zip(module.named_children(), module.wirings)]
    return [Layer(m, Wiring(), name) for name, m in module.named_children()]


def whole_model_layers(module: torch.nn.Module, args: tuple, kwargs: dict,
                       dynamic_shapes=None) -> tuple[list[Layer], Interface]:
    """Any other module: its forward captured whole in both modes from the example arguments and cut into units
    (client_sdk/whole_model_cuts.py); with the interface the deployment is called through."""
    if not args and not kwargs:
        raise InvalidArgument(f"a {type(module).__name__} is captured whole, from an example: pass "
                              "example_input=<a tensor shaped like one batch> (or example_inputs=(...), "
                              "example_kwargs={...} for several)")
    signature = inspect.signature(module.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise InvalidArgument(f"the example does not fit {type(module).__name__}.forward{signature}: {error}") from None
    for name, value in bound.arguments.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise InvalidArgument(f"the model's inputs must be tensors, each its own argument; the example gives "
                                  f"{name!r} a {type(value).__name__}")
    args, kwargs = tuple(_rows(a) for a in bound.args), {k: _rows(v) for k, v in bound.kwargs.items()}
    spec = _with_batch(bound, dynamic_shapes)
    with untouched(module):
        train, evaluation = (_cut(module.train(training), args, kwargs, spec) for training in (True, False))
    shapes = lambda cut: [(len(w.dependencies), len(w.out_variables)) for w in cut.wirings]  # noqa: E731
    if train.names != evaluation.names or shapes(train) != shapes(evaluation) or train.inputs != evaluation.inputs:
        raise InvalidArgument(f"{type(module).__name__} passes different values between its parts in training and "
                              "eval mode, so one cut cannot serve both; deploy it as an nn.Sequential")
    _check_names(train, evaluation)
    layers = [Layer(m, w, "", name=n, description=d, eval_module=e, varying=v,
                    constants=tuple((k, t) for k, t in train.constants.items()
                                    if k in {keys.get(b, b) for b, _ in m.named_buffers()}),
                    keys=tuple(keys.items()))
              for m, w, n, d, e, v, keys in zip(train.modules, train.wirings, train.names, train.descriptions,
                                                evaluation.modules, train.varying, train.keys)]
    return layers, Interface(signature, tuple(train.inputs), tuple(train.outputs), tuple(train.leaves),
                             train.out_spec, train.limits)


def _check_names(train: whole_model_cuts.CutGraph, evaluation: whole_model_cuts.CutGraph) -> None:
    """Both modes' graphs of a unit name each weight alike: the stages look weights up by the training graph's
    names."""
    for name, trained, evaluated in zip(train.names, train.keys, evaluation.keys):
        differing = [local for local, key in evaluated.items() if trained.get(local, key) != key]
        if differing:
            raise InvalidArgument(f"the model's unit {name!r} names weight {differing[0]!r} differently in training "
                                  "and eval mode; deploy it as an nn.Sequential")


def _cut(module: torch.nn.Module, args: tuple, kwargs: dict, spec: dict) -> whole_model_cuts.CutGraph:
    """The module, in the mode it is in, captured whole and cut into units."""
    try:
        program = whole_model_cuts.export_model(module, args, kwargs, spec, warn=module.training)
    except Exception as error:  # export reports unsupported code in many exception types
        mode = "training" if module.training else "eval"
        raise InvalidArgument(f"{type(module).__name__} cannot be captured with torch.export in {mode} "
                              f"mode{_user_line(error)}: {_why(error)}") from None
    return whole_model_cuts.cut(program, module)


def _rows(x):
    if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] > EXAMPLE_BATCH:
        return x[:EXAMPLE_BATCH]
    return x


def _with_batch(bound: inspect.BoundArguments, dynamic_shapes):
    """The user's dynamic_shapes (torch.export's form, by argument name or position) by argument name, with dim 0
    of every tensor argument they leave out as the batch."""
    batch = torch.export.Dim("batch", min=1)
    names = list(bound.arguments)
    if dynamic_shapes is None:
        given = {}
    elif isinstance(dynamic_shapes, dict):
        given = dict(dynamic_shapes)
    elif isinstance(dynamic_shapes, (tuple, list)):
        given = dict(zip(names, dynamic_shapes))
    else:
        raise InvalidArgument(f"dynamic_shapes must be a dict by argument name or a tuple by position, as "
                              f"torch.export takes it; got {dynamic_shapes!r}")
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise InvalidArgument(f"dynamic_shapes names {unknown}, which the example does not give (it gives {names})")
    spec = {}
    for name, value in bound.arguments.items():
        dims = given.get(name)
        if isinstance(value, torch.Tensor) and value.dim() and (dims is None or isinstance(dims, dict)):
            dims = {0: batch, **(dims or {})}
        spec[name] = dims
    return spec


def split_indexes(layers: Sequence[Layer], split_points: Sequence) -> list[int]:
    """Split points as layer indexes: each given as an index or as the name of the layer a stage starts with."""
    indexes = []
    for point in split_points:
        if isinstance(point, str):  # a part's name, or a container's: its first part
            point = _parts_named(layers, point, f"split point {point!r} is not a part the model can be cut before; "
                                                "those are")[0]
        indexes.append(int(point))
    return indexes


def _parts_named(layers: Sequence[Layer], name: str, refusal: str) -> list[int]:
    """The indexes of the layers named `name` or lying under it (a container's name); InvalidArgument, `refusal`
    followed by the parts' names, for none."""
    names = [layer.name or layer.prefix for layer in layers]
    chosen = [i for i, known in enumerate(names) if known == name or known.startswith(name + ".")]
    if not chosen:
        raise InvalidArgument(f"{refusal} {names[:12]}{' ...' if len(names) > 12 else ''}")
    return chosen


def mark_recomputed(layers: Sequence[Layer], captured: Sequence[shard_pb2.CapturedLayer],
                    names: Sequence[str]) -> None:
    """Flags each captured layer named in `names` (or lying under one) to be recomputed in backward."""
    for name in names:
        for index in _parts_named(layers, name, f"recompute names {name!r}, which is no part of the model; its "
                                                "parts are"):
            captured[index].recompute = True


def example_input(module: torch.nn.Module, layers: Sequence[Layer]) -> torch.Tensor:
    """An input to trace with, when the user gave none: from the seed shapes or a first Linear (drawn without
    moving torch's random stream)."""
    first = layers[0].module if layers else None
    with torch.random.fork_rng(devices=[]):
        if isinstance(module, LayerList):
            return module.example_input(EXAMPLE_BATCH)
        if isinstance(first, torch.nn.Linear):
            return torch.randn(EXAMPLE_BATCH, first.in_features)
    raise InvalidArgument(f"cannot guess the input of a model starting with {type(first).__name__}; "
                          "pass example_input=<a tensor shaped like one batch>")


def capture_model(module: torch.nn.Module, layers: Sequence[Layer], example: torch.Tensor | None = None,
                  inputs: dict[str, torch.Tensor] | None = None) -> list[shard_pb2.CapturedLayer]:
    """Captures every layer of `module` (see capture), tracing with `example` or a guessed input (and the model's
    other inputs by name), and leaves the module as it was: its buffers (a BatchNorm's running statistics), its
    layers' train/eval modes, and torch's random stream, which the example and a Dropout would otherwise draw
    from."""
    with untouched(module):
        return capture(layers, example if example is not None else example_input(module, layers), inputs or {})


def describe_inputs(module: torch.nn.Module, layers: Sequence[Layer], captured: Sequence[shard_pb2.CapturedLayer],
                    example: torch.Tensor | None, inputs: dict[str, torch.Tensor] | None = None) -> None:
    """Sets each captured layer's example_inputs (what the shards measure it on) from one forward on `example` (or a
    guessed input) and the model's other inputs, leaving the model as it was."""
    with untouched(module):
        x = example if example is not None else example_input(module, layers)
        for entry, specs in zip(captured, profile_inputs.example_inputs(layers, x, inputs or {})):
            entry.example_inputs.extend(specs)


def weigh(captured: Sequence[shard_pb2.CapturedLayer], layers: Sequence[Layer], state_tensors: int) -> None:
    """Sets what each captured layer's weights need on a shard: with their gradients and optimizer state (the
    shards that measure a layer add the activations it saves)."""
    for layer, entry in zip(layers, captured):
        entry.memory_bytes = weight_bytes(layer, state_tensors)


def weight_bytes(layer: Layer, state_tensors: int) -> int:
    """What a layer's weights take on a shard while training: each trainable one with its gradient and
    `state_tensors` optimizer tensors of its size, each other one (buffers, frozen weights) once."""
    total = 0
    for key, tensor in layer.module.state_dict(keep_vars=True).items():
        trains = isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad
        total += tensor.numel() * tensor.element_size() * (2 + state_tensors if trains else 1)
    return total


def warn_frozen(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Warns, naming them, of the Python values the model's forward reads that a capture fixes (one forward on the
    example, leaving the model as it was)."""
    with untouched(module), torch.no_grad(), whole_model_cuts.shapes_only(module, (args, kwargs)):
        module.train()
        reads = frozen.frozen_reads(module, lambda: module(*(_rows(a) for a in args),
                                                           **{k: _rows(v) for k, v in kwargs.items()}))
    if reads:
        warnings.warn(f"the deployment keeps the values these Python reads of the forward had at deploy: "
                      f"{', '.join(reads[:8])}{' ...' if len(reads) > 8 else ''}; changing them later does not reach "
                      "the shards (deploy again after changing them; draw randomness with torch instead)",
                      stacklevel=4)


def held_beyond_state_dict(module: torch.nn.Module, layers: Sequence[Layer],
                           captured: Sequence[shard_pb2.CapturedLayer]) -> dict[str, torch.Tensor]:
    """What the stages hold that the model's state_dict leaves out, by key: non-persistent buffers (a rotary
    embedding's inv_freq, a mask) and tensors the forward makes; only those some stage's graph reads."""
    persistent = set(module.state_dict())
    held = {entry.model_key for layer in captured for entry in layer.state}
    values = {key: value for key, value in module.named_buffers(remove_duplicate=False) if key not in persistent}
    values.update(pair for layer in layers for pair in layer.constants)
    return {key: value for key, value in values.items() if key in held}


def tied_keys(module: torch.nn.Module) -> dict[str, str]:
    """Every state-dict key of a tensor that more than one key holds (tied weights), mapped to the first of them in
    the model's order (the one net.named_parameters() keeps)."""
    return {key: group[0] for group in whole_model_cuts.shared_keys(module) for key in group}


def mark_state(captured: Sequence[shard_pb2.CapturedLayer], module: torch.nn.Module) -> None:
    """Marks each captured weight tied to others with the first key of its tensor (StateEntry.tied_to), a weight
    read by several layers under one key as tied to that key, and each parameter that takes no gradient as
    frozen."""
    tied = tied_keys(module)
    frozen_keys = {key for key, parameter in module.named_parameters(remove_duplicate=False)
                   if not parameter.requires_grad}
    layers_of_key = collections.Counter(entry.model_key for layer in captured for entry in layer.state)
    for layer in captured:
        for entry in layer.state:
            # a weight several layers read under one key is tied to itself: the same, should they land apart
            shared = entry.model_key if layers_of_key[entry.model_key] > 1 else ""
            entry.tied_to = tied.get(entry.model_key, shared)
            entry.frozen = entry.model_key in frozen_keys


def capture(layers: Sequence[Layer], x: torch.Tensor,
            inputs: dict[str, torch.Tensor] | None = None) -> list[shard_pb2.CapturedLayer]:
    """Captures each layer in training mode, and in eval mode too where its forward reads `training` (Dropout,
    BatchNorm, a custom layer's own branch), with the activations an example input produces on the way
    through (in training mode, as the shards will train). Runs the layers: capture_model keeps the model
    as it was."""
    captured, saved = [], {name: _rows(value) for name, value in (inputs or {}).items()}
    x = _rows(x)
    programs: dict[tuple, tuple[bytes, bytes]] = {}  # by what a unit's capture depends on: identical units once
    with torch.no_grad():
        for index, layer in enumerate(layers):
            adapter = LayerAdapter(layer.module, layer.wiring.out_variables).train()
            # contiguous, as they arrive on a shard: export's guards and strides describe the example's layout
            args = tuple(a.contiguous() for a in (x, *(saved[name] for name in layer.wiring.dependencies)))
            with ModeReads(adapter) as reads:
                result = adapter(*args)
            same = _capture_key(layer, args)
            if same is None or same not in programs or not _fits(programs[same][0], adapter):
                programs[same] = _export_modes(index, layer, adapter, args, reads.seen)
            captured.append(_describe(index, layer, adapter, *programs[same]))
            x = passed_on(result, layer.wiring, saved)
    return captured


def _export_modes(index: int, layer: Layer, adapter: LayerAdapter, args: tuple[torch.Tensor, ...],
                  reads_training: bool) -> tuple[bytes, bytes]:
    """The layer's training-mode program, and its eval-mode one where that differs (b"" where it does not)."""
    program, eval_program = _export(index, layer, adapter, args), b""
    if layer.eval_module is not None:
        eval_adapter = LayerAdapter(layer.eval_module, layer.wiring.out_variables).eval()
        eval_program = _export(index, layer, eval_adapter, args)
    elif reads_training:
        eval_program = _export(index, layer, adapter.eval(), args)
        adapter.train()
    return program, b"" if eval_program == program else eval_program


def _capture_key(layer: Layer, args: tuple[torch.Tensor, ...]) -> tuple | None:
    """What a unit's programs depend on besides its weights' values: both modes' graphs (whole_model_cuts.structure)
    and its inputs' shapes, dtypes and varying dims. None for a layer that is not a unit graph: captured on its own."""
    train, evaluation = whole_model_cuts.structure(layer.module), whole_model_cuts.structure(layer.eval_module)
    if train is None or evaluation is None:
        return None
    inputs = tuple((tuple(a.shape), a.dtype, a.stride()) for a in args)
    return train, evaluation, inputs, layer.varying, len(layer.wiring.out_variables)


def _fits(program: bytes, adapter: LayerAdapter) -> bool:
    """Whether a program captured for another unit takes exactly this one's weights (names, shapes, dtypes)."""
    state = adapter.state_dict(keep_vars=True)
    specs = CapturedProgram(program).state_specs()
    return [spec.graph_key for spec in specs] == list(state) and all(
        spec.shape == tuple(state[spec.graph_key].shape) and spec.dtype == state[spec.graph_key].dtype and
        spec.is_parameter == isinstance(state[spec.graph_key], torch.nn.Parameter) for spec in specs)


def _export(index: int, layer: Layer, adapter: LayerAdapter, args: tuple[torch.Tensor, ...]) -> bytes:
    what = layer.description or type(layer.module).__name__
    try:
        program = capture_layer(adapter, args, layer.varying)
    except Exception as error:  # export reports unsupported code in many exception types
        mode = "training" if adapter.training else "eval"
        raise InvalidArgument(f"layer {index} ({what}) cannot be captured with torch.export in {mode} "
                              f"mode{_user_line(error)}: {_why(error)}") from None
    try:
        CapturedProgram(program)  # the shards' own checks, here, before anything is shipped
    except InvalidArgument as error:
        raise InvalidArgument(f"layer {index} ({what}): {error}{_located(program, layer, str(error))}") from None
    return program


def _located(program: bytes, layer: Layer, message: str) -> str:
    """"; in MODULE at FILE:LINE (`code`)": where in the user's model the operator a refusal names was called, from
    the capture's stack traces (the unit's own graph for a model captured whole, else the program's metadata)."""
    nodes = json.loads(program)["graph_module"]["graph"]["nodes"]
    node = next((n for n in nodes if n["target"] in message or n["target"].removeprefix("torch.ops.") in message),
                None)
    if node is None:
        return ""
    trace, path = node["metadata"].get("stack_trace", ""), node["metadata"].get("nn_module_stack", "")
    path = path.split(";")[-1].split(",")[1].removeprefix("layer").lstrip(".") if path else ""
    if isinstance(layer.module, torch.fx.GraphModule):  # a unit: its nodes keep the whole model's traces
        target = node["target"].removeprefix("torch.ops.")
        original = next((n for n in layer.module.graph.nodes if str(n.target) == target), None)
        if original is not None:
            trace = original.meta.get("stack_trace") or trace
            stack = original.meta.get("nn_module_stack") or {}
            path = next(reversed(stack.values()))[0] if stack else layer.name
    return f"; in {path or layer.name or layer.prefix or 'the layer'}" + _frame_of(trace)


# Where frames of torch's, this project's or Python's own code come from: a user's line is in none of them.
_NOT_USERS = (os.sep + "torch" + os.sep, os.sep + "client_sdk" + os.sep, os.sep + "shardtrain" + os.sep, "<frozen")


def _frame_of(trace: str) -> str:
    """ " at FILE:LINE (`code`)" for the deepest frame of a stack trace outside torch and this project."""
    lines = trace.splitlines()
    frames = [(i, line.strip()) for i, line in enumerate(lines) if line.strip().startswith('File "')]
    frames = [(i, line) for i, line in frames if not any(part in line for part in _NOT_USERS)]
    if not frames:
        return ""
    i, line = frames[-1]
    file, _, rest = line.removeprefix('File "').partition('", line ')
    code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File ") else ""
    return f" at {file}:{rest.split(',')[0]}" + (f" (`{code[:80]}`)" if code else "")


_DATA_DEPENDENT = ("GuardOnDataDependentSymNode", "data-dependent", "Data-dependent")


def _why(error: Exception) -> str:
    """What export refused, in a line, and what to do about it: torch's own message runs to pages."""
    text = str(error)
    if any(mark in text or mark in type(error).__name__ for mark in _DATA_DEPENDENT):
        return ("its forward takes a path that depends on the values in a tensor (an `if` or a loop on them, "
                ".item(), .tolist()); a captured graph has one path for every input. Compute both branches and "
                "pick with torch.where, or make the decision outside the model")
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first[:300]}"


def _user_line(error: Exception) -> str:
    """ " at FILE:LINE (`code`)": the deepest frame of the failure in the user's code, not torch's or ours."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if not any(part in frame.filename for part in _NOT_USERS)]
    if not frames:
        return ""
    frame = frames[-1]
    return f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()[:80]}`)"


def _describe(index: int, layer: Layer, adapter: LayerAdapter, program: bytes,
              eval_program: bytes) -> shard_pb2.CapturedLayer:
    keys = dict(layer.keys)
    state = [shard_pb2.StateEntry(graph_key=key, model_key=_model_key(layer.prefix, key, keys))
             for key in adapter.state_dict()]
    return shard_pb2.CapturedLayer(index=index, description=layer.description or _one_line(layer.module),
                                   program=program,
                                   dependencies=layer.wiring.dependencies,
                                   out_variables=layer.wiring.out_variables, state=state, cost=layer.cost,
                                   eval_program=eval_program)


def _model_key(prefix: str, graph_key: str, keys: dict[str, str]) -> str:
    local = graph_key.removeprefix("layer.")
    local = keys.get(local, local)
    return f"{prefix}.{local}" if prefix else local


def _one_line(module: torch.nn.Module) -> str:
    text = repr(module).replace("\n", " ")
    return " ".join(text.split())[:120]
