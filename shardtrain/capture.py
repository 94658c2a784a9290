"""Layers as captured graphs: torch.export on the client, a validated, pickle-free load on the shard.

`torch.export.load` falls back to `torch.load(weights_only=False)` and the serialized program it
reads is trusted input (operator names resolved by getattr, guard strings exec'd, node names
pasted into generated source). So a shard never calls it: it checks every string in the program
against an allow-list first (shape expressions and guards by the grammar of shardtrain/symbolic.py),
every operator against the rule of shardtrain/operators.py, then hands the deserializer weights it
received as plain tensors, and re-checks the built graph's shapes (shardtrain/propagation.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch._export.serde import schema as export_schema

from shardtrain import operators, symbolic
from shardtrain.errors import InvalidArgument

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOTTED = re.compile(r"([A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*)?")
_OPERATOR = re.compile(r"torch\.ops\.aten\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+|torch\.ops\.higher_order\.[A-Za-z0-9_]+|"
                       r"_operator\.[a-z_]+")
# Strings that only label things (dtype names, dialects, kinds): no quotes, spaces or brackets.
_PLAIN = re.compile(r"[A-Za-z0-9_.:\-]*")
_NAME_KEYS = {"name", "parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name",
              "user_input_name", "user_output_name", "input_name", "output_name", "fqn"}
_FREE_TEXT_KEYS = {"as_string", "torch_version"}  # string constants: emitted with repr(), never parsed
_TREESPEC_KEYS = {"in_spec", "out_spec"}  # pytree specs, themselves JSON
_TREESPEC_TYPES = {None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict"}
MAX_PROGRAM_BYTES = 32 << 20  # one layer's serialized graph; real layers' graphs are far smaller
MAX_STRING = 4096             # characters in any one string of a program
_INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class StateSpec:
    """A weight a captured graph expects: its name in the graph, shape, dtype and whether it trains."""

    graph_key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_parameter: bool


class LayerAdapter(torch.nn.Module):
    """Gives every layer one calling convention: forward(x, *dependencies) -> x or (x, *saved).

    A seed-style layer with `out_variables` returns (x, [(name, tensor), ...]); the adapter keeps the
    tensors in `out_variables` order so a captured graph has plain tensor outputs. A plain layer
    given `out_variables` saves its own output under those names.
    """

    def __init__(self, layer: torch.nn.Module, out_variables: tuple[str, ...] = ()):
        super().__init__()
        self.layer = layer
        self.out_variables = tuple(out_variables)

    def forward(self, x: torch.Tensor, *dependencies: torch.Tensor):
        result = self.layer(x, *dependencies)
        if not self.out_variables:
            return result
        if isinstance(result, torch.Tensor):  # a plain layer: what it saves is its output
            return (result, *(result for _ in self.out_variables))
        if all(isinstance(value, torch.Tensor) for value in result):  # (output, *saved) in out_variables order
            return result
        output, saved = result
        named = dict(saved)
        return (output, *(named[name] for name in self.out_variables))


# torch.export's tracing keeps its state in process globals: two threads capturing at once break each other's traces
# (and report it as a model that cannot be captured). Whatever captures in a process holds this lock meanwhile.
CAPTURING = threading.RLock()


def capture_layer(adapter: LayerAdapter, example_args: tuple[torch.Tensor, ...],
                  varying: tuple[tuple[int, ...], ...] | None = None) -> bytes:
    """Exports a layer with a dynamic batch (dim 0) on every input, or the dims `varying` names per input;
    returns the program without weights. Exported with autograd on, as the layer trains: a region its forward
    runs under torch.no_grad() is recorded as one only where it changes the grad mode."""
    if varying is None:
        batch = torch.export.Dim("batch", min=1)
        per_input = [{0: batch} if arg.dim() > 0 else {} for arg in example_args]
    else:
        per_input = [{dim: torch.export.Dim.DYNAMIC for dim in dims} for dims in varying]
    dynamic: dict = {"x": per_input[0]}
    if len(example_args) > 1:  # export wants the varargs key only when varargs were given
        dynamic["dependencies"] = tuple(per_input[1:])
    with torch.enable_grad():
        program = torch.export.export(adapter, tuple(example_args), dynamic_shapes=dynamic)
    try:
        artifact = _serde().serialize(program, serialize_state_dict=False, serialize_constants=False,
                                      serialize_example_inputs=False)
    except TypeError:  # an older torch (a GPU image's own build) serializes the weights too; they are dropped here
        artifact = _serde().serialize(program)
    return artifact.exported_program


def _check_string(key: str, value: str, path: str) -> None:
    if len(value) > MAX_STRING:
        raise InvalidArgument(f"captured program: {path} is a string of {len(value)} characters; "
                              f"at most {MAX_STRING} are allowed")
    if key == "target":
        ok = _OPERATOR.fullmatch(value) is not None
    elif key == "expr_str":
        try:
            symbolic.check_expression(value)
        except InvalidArgument as error:
            raise InvalidArgument(f"captured program: {path}: {error}") from None
        ok = True
    elif key in _NAME_KEYS:
        ok = _DOTTED.fullmatch(value) is not None
    elif key in _FREE_TEXT_KEYS:
        ok = True
    elif key in _TREESPEC_KEYS:
        ok = _is_plain_treespec(value)
    else:
        ok = _PLAIN.fullmatch(value) is not None
    if not ok:
        raise InvalidArgument(f"captured program: {path} = {value[:80]!r} is not allowed "
                              f"(only aten operators and plain names may appear)")


def _is_plain_treespec(text: str) -> bool:
    """True for a pytree spec made of tuples, lists and dicts keyed by plain names."""
    try:
        _protocol, root = json.loads(text)
        pending = [root]
        while pending:
            node = pending.pop()
            context = json.loads(node["context"]) if isinstance(node["context"], str) else node["context"]
            names = context if isinstance(context, list) else [] if context is None else [None]
            if node["type"] not in _TREESPEC_TYPES or not all(
                    isinstance(n, str) and _PLAIN.fullmatch(n) for n in names):
                return False
            pending.extend(node["children_spec"])
        return True
    except (ValueError, TypeError, KeyError):
        return False


def _check_tree(node: Any, key: str = "", path: str = "program") -> None:
    if isinstance(node, dict):
        for child_key, child in node.items():
            _check_tree(child, child_key, f"{path}.{child_key}")
    elif isinstance(node, list):
        for index, child in enumerate(node):
            _check_tree(child, key, f"{path}[{index}]")
    elif isinstance(node, str):
        _check_string(key, node, path)
    elif isinstance(node, int) and not _INT64[0] <= node <= _INT64[1]:
        raise InvalidArgument(f"captured program: {path} = {str(node)[:40]} does not fit in 64 bits")


def _parse_program(program: bytes) -> dict:
    if len(program) > MAX_PROGRAM_BYTES:
        raise InvalidArgument(f"captured program is {len(program)} bytes; at most {MAX_PROGRAM_BYTES} are allowed")
    try:
        tree = json.loads(program)
    except (ValueError, RecursionError) as error:
        raise InvalidArgument(f"captured program is not valid JSON: {str(error)[:200]}") from None
    if not isinstance(tree, dict) or "graph_module" not in tree:
        raise InvalidArgument("captured program has no graph_module")
    guards = tree.get("guards_code", [])
    if not isinstance(guards, list) or not all(isinstance(guard, str) for guard in guards):
        raise InvalidArgument("captured program: guards_code must be a list of strings")
    for guard in guards:
        if len(guard) > MAX_STRING:
            raise InvalidArgument(f"captured program: a guard of {len(guard)} characters; at most {MAX_STRING}")
    try:
        _drop_metadata(tree["graph_module"]["graph"])
    except (KeyError, TypeError, AttributeError) as error:
        raise InvalidArgument(f"captured program is malformed: {type(error).__name__}: {error}") from None
    body = {k: v for k, v in tree.items() if k != "guards_code"}
    _check_tree(body)
    try:
        operators.check_graph(tree["graph_module"])
    except InvalidArgument:
        raise
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as error:
        raise InvalidArgument(f"captured program is malformed: {type(error).__name__}: {error}") from None
    return tree


def _drop_metadata(graph: dict, depth: int = 0) -> None:
    """Empties every node's metadata, in the graphs higher-order operators carry too: stack traces and module
    paths are not needed to run, and not trusted."""
    if depth > operators.MAX_DEPTH:
        raise InvalidArgument(f"captured program nests graphs more than {operators.MAX_DEPTH} deep")
    for node in graph.get("nodes", []):
        node["metadata"] = {}
        for inner in operators.subgraphs(node):
            _drop_metadata(inner["graph"], depth + 1)


class CapturedProgram:
    """A captured layer received from the wire, checked once, then read for specs or rebuilt."""

    def __init__(self, program: bytes):
        self._tree = _parse_program(program)
        self._digest = hashlib.sha256(program).digest()
        self.guards = [symbolic.Guard(text) for text in self._tree.get("guards_code", [])]
        try:
            graph_module = self._tree["graph_module"]
            self._values = graph_module["graph"]["tensor_values"]
            self._inputs = [next(iter(spec.items())) for spec in graph_module["signature"]["input_specs"]]
        except (KeyError, TypeError, AttributeError, StopIteration) as error:
            raise InvalidArgument(f"captured program is malformed: {type(error).__name__}: {error}") from None

    def state_specs(self) -> list[StateSpec]:
        """The parameters and buffers the program expects, read from the program itself."""
        specs = []
        for kind, body in self._inputs:
            if kind in ("parameter", "buffer"):
                meta = self._values[body["arg"]["name"]]
                shape = tuple(size["as_int"] for size in meta["sizes"])
                specs.append(StateSpec(body[f"{kind}_name"], shape, _dtype(meta), kind == "parameter"))
        return specs

    def input_specs(self) -> list[InputSpec]:
        """The user inputs (main input first, then dependencies), in order."""
        specs = []
        for kind, body in self._inputs:
            if kind == "user_input":
                meta = self._values[body["arg"]["as_tensor"]["name"]]
                specs.append(InputSpec(_dtype(meta), tuple(size.get("as_int") for size in meta["sizes"])))
        return specs

    def output_specs(self) -> list[InputSpec]:
        """The outputs' dtypes and shapes (main output first, then the saved out_variables), in order."""
        try:
            outputs = self._tree["graph_module"]["signature"]["output_specs"]
            names = [spec["user_output"]["arg"]["as_tensor"]["name"] for spec in outputs if "user_output" in spec]
            return [InputSpec(_dtype(self._values[name]), tuple(size.get("as_int") for size in
                                                                 self._values[name]["sizes"])) for name in names]
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            raise InvalidArgument(f"captured program is malformed: {type(error).__name__}: {error}") from None

    def load(self, state: dict[str, torch.Tensor], device: torch.device | None = None) -> torch.nn.Module:
        """Rebuilds the layer around the given weights (Parameters and buffers, used as they are), making the
        tensors its operations create (an arange, a mask) on `device` rather than where it was captured."""
        self._check_state(state)
        exported = copy.copy(self._built(state, device))
        exported._state_dict = dict(state)
        module = _without_input_checks(exported.module())
        if self.guards:
            check = symbolic.check_layer_inputs(self.guards)
            module.register_forward_pre_hook(lambda _module, arguments: check(arguments))
        return module


    def _built(self, state: dict[str, torch.Tensor], device: torch.device | None) -> torch.export.ExportedProgram:
        """The program deserialized and checked, without weights: once per program and device (a model's identical
        blocks share one), since deserializing costs several times what making a module of it does."""
        key = (self._digest, str(device))
        if key in _BUILT:
            _BUILT.move_to_end(key)
            return _BUILT[key]
        try:
            serde = _serde()
            serialized = serde._dict_to_dataclass(export_schema.ExportedProgram, self._tree)
            exported = serde.ExportedProgramDeserializer().deserialize(serialized, state, {}, None)
        except Exception as error:  # the deserializer raises many types; all mean a bad program
            raise InvalidArgument(f"captured program does not load: {type(error).__name__}: {error}") from None
        _check_targets(exported)
        from shardtrain import propagation  # fake tensors and symbolic shapes: loaded by the processes that build
        propagation.check_program_shapes(self._digest, exported.graph)
        if device is not None:
            _create_on(exported.graph_module, device)
        exported._state_dict = {}  # the weights are each load's own
        _BUILT[key] = exported
        if len(_BUILT) > BUILT_KEPT:
            _BUILT.popitem(last=False)
        return exported

    def _check_state(self, state: dict[str, torch.Tensor]) -> None:
        """InvalidArgument unless `state` holds exactly the weights the program expects, each of its shape, dtype and
        kind (a Parameter or a buffer)."""
        specs = {spec.graph_key: spec for spec in self.state_specs()}
        if set(state) != set(specs):
            raise InvalidArgument(f"captured program expects weights {sorted(specs)[:8]}, got {sorted(state)[:8]}")
        for key, spec in specs.items():
            tensor = state[key]
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype or \
                    isinstance(tensor, torch.nn.Parameter) != spec.is_parameter:
                kind = "parameter" if spec.is_parameter else "buffer"
                raise InvalidArgument(f"captured program: weight {key!r} should be a {kind} of {spec.dtype} "
                                      f"{list(spec.shape)}, got {type(tensor).__name__} of {tensor.dtype} "
                                      f"{list(tensor.shape)}")


_BUILT: OrderedDict[tuple[bytes, str], torch.export.ExportedProgram] = OrderedDict()  # checked programs by digest
BUILT_KEPT = 256                                                                      # and device, without weights

_BATCH_NORMS = ("batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional")


def one_row_batch_norm(module: torch.nn.Module) -> list | None:
    """The input shape (batch first) of a training-mode batch norm in a loaded layer that a batch of one row would
    give one value per channel, or None.

    F.batch_norm refuses, in Python, to normalise one value per channel while training (its variance would be
    0/0 and poison the running statistics); capture drops that check. A training-mode batch norm whose input has
    nothing but the batch beside its channels (an [N, C] or [N, C, 1] input) needs at least 2 rows."""
    for node in getattr(module, "graph", torch.fx.Graph()).nodes:
        name = getattr(getattr(node.target, "_schema", None), "name", "").removeprefix("aten::")
        if node.op != "call_function" or name not in _BATCH_NORMS or len(node.args) < 6 or node.args[5] is not True:
            continue
        value = getattr(node.args[0], "meta", {}).get("val")
        if value is None or value.dim() < 2 or isinstance(value.shape[0], int):
            continue  # not batch-first: nothing to check up front
        if all(isinstance(size, int) and size == 1 for size in value.shape[2:]):
            return ["batch", *value.shape[1:]]
    return None


def _create_on(graph_module: torch.fx.GraphModule, device: torch.device) -> None:
    """Points every operation that names a device (factories' `device=`, `to(device)`) at `device`. Not
    torch.export.passes.move_to_device_pass: it would wrap the stage's weights in new Parameters, and their
    gradients would no longer reach the stage's optimizer."""
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if "device" in node.kwargs:
                node.kwargs = {**node.kwargs, "device": device}
            if node.op == "call_function" and node.target is torch.ops.aten.to.device:
                node.args = (node.args[0], device, *node.args[2:])
        module.recompile()


def _without_input_checks(module: torch.nn.Module) -> torch.nn.Module:
    """Drops export's per-call input-constraint hook, which costs about as much as a small layer's own call:
    the shard checks each stage's inputs once instead."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if getattr(hook, "__name__", "") == "_check_input_constraints_pre_hook":
            del module._forward_pre_hooks[key]
    return module


def _check_targets(exported: torch.export.ExportedProgram) -> None:
    """The built graph, and those its higher-order operators carry, call what the checked program named: allowed
    operators only (a second look)."""
    for module in exported.graph_module.modules():
        for node in getattr(module, "graph", torch.fx.Graph()).nodes:
            if node.op == "call_function" and _refusal(node.target) is not None:
                raise InvalidArgument(f"captured program calls {node.target!r}, which {_refusal(node.target)}")
            if node.op in ("call_module", "call_method"):
                raise InvalidArgument(f"captured program has a {node.op} node; only torch operators are allowed")


def _refusal(target) -> str | None:
    """Why a built node's target may not run, or None."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return operators.refusal(target._schema.name.removeprefix("aten::"), target._schema, target.tags)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return None if target.name() in operators.HIGHER_ORDER else "is not an allowed higher-order operator"
    allowed = f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', '')}"
    return None if allowed in operators.ALLOWED_PYTHON else "is not an allowed operator"


@dataclass(frozen=True)
class InputSpec:
    """What a captured graph accepts for one input: dtype and shape, None where the size is free."""

    dtype: torch.dtype
    shape: tuple[int | None, ...]

    def check(self, tensor: torch.Tensor, what: str) -> None:
        """InvalidArgument naming `what` when the tensor's dtype or shape do not fit."""
        fits = tensor.dtype == self.dtype and tensor.dim() == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, tensor.shape))
        if not fits:
            wanted = "[" + ", ".join("batch" if size is None else str(size) for size in self.shape) + "]"
            raise InvalidArgument(f"{what}: expected {str(self.dtype).removeprefix('torch.')} of shape {wanted}, "
                                  f"got {str(tensor.dtype).removeprefix('torch.')} of shape {list(tensor.shape)}")


def _serde():
    """torch's export (de)serializer, imported where a program is written or built: importing it loads
    torch._dynamo, which a process reading only a program's specs (the coordinator) never needs."""
    from torch._export.serde import serialize
    return serialize


# The serialized dtypes by their schema name, as torch's serializer reads them; here so that reading a program's
# specs needs no serializer (tests/unit/test_capture.py checks the table against it).
_DTYPE_NAMES = {"BYTE": "uint8", "CHAR": "int8", "UINT16": "uint16", "SHORT": "int16", "INT": "int32",
                "LONG": "int64", "HALF": "float16", "FLOAT": "float32", "DOUBLE": "float64",
                "COMPLEXHALF": "complex32", "COMPLEXFLOAT": "complex64", "COMPLEXDOUBLE": "complex128",
                "BOOL": "bool", "BFLOAT16": "bfloat16", "FLOAT8E4M3FN": "float8_e4m3fn", "FLOAT8E5M2": "float8_e5m2",
                "FLOAT8E4M3FNUZ": "float8_e4m3fnuz", "FLOAT8E5M2FNUZ": "float8_e5m2fnuz",
                "FLOAT8E8M0FNU": "float8_e8m0fnu", "UINT32": "uint32", "UINT64": "uint64"}
SERIALIZED_DTYPES = {int(getattr(export_schema.ScalarType, name)): getattr(torch, dtype)
                     for name, dtype in _DTYPE_NAMES.items()
                     if hasattr(export_schema.ScalarType, name) and hasattr(torch, dtype)}


def _dtype(meta: dict) -> torch.dtype:
    try:
        return SERIALIZED_DTYPES[meta["dtype"]]
    except (KeyError, TypeError):
        raise InvalidArgument(f"captured program: a tensor of unknown dtype {meta['dtype']!r}") from None
