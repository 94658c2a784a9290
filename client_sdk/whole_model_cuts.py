"""Any module as layers: its whole forward captured once with torch.export, then cut at module boundaries.

Each unit (a submodule that holds no container of modules: a transformer block, an embedding, a head; the search
descends through containers and through every module that holds one, so `transformer.h.3` of a GPT-2 or
`model.layers.7` of a Llama is a unit) becomes one layer of the chain the shards run: the value passed on to the next
unit travels as the layer's main input, every other value a later unit reads (int64 token ids, masks, skip
connections) as a named residual. So cutting between any two units works for any tensors crossing the cut, with no
second engine.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import sympy

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from client_sdk.modes import untouched
from shardtrain.errors import InvalidArgument
from shardtrain.residuals import Wiring

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


@dataclass
class CutGraph:
    """A whole-model graph cut into units: per unit, its graph module, wiring and the dynamic dims of its inputs."""

    names: list[str]
    modules: list[torch.nn.Module]
    wirings: list[Wiring]
    varying: list[tuple[tuple[int, ...], ...]]  # per unit, per input (main first), the dims that vary
    descriptions: list[str]
    inputs: list[str]    # the model's tensor inputs by name, in order: the first is the main input
    outputs: list[str]   # the last unit's saved values that are the model's outputs after the first
    leaves: list         # the model's flat outputs: ("main", None), ("output", name) or ("constant", value)
    out_spec: object     # the pytree spec the flat outputs rebuild into (a tuple, a dict, one tensor)
    limits: dict[str, dict[int, int]] = field(default_factory=dict)  # per input, dims with a largest size
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # tensors the forward makes, by their key
    keys: list[dict[str, str]] = field(default_factory=list)  # per unit, its weights' names in it -> model keys


def unit_names(module: torch.nn.Module) -> list[str]:
    """The module paths a model can be cut between: its submodules, looking through containers and through every
    module that holds a container (a GPT-2's `transformer`, a BERT's `bert.encoder`) down to the blocks."""
    names: list[str] = []

    def walk(prefix: str, parent: torch.nn.Module) -> None:
        for name, child in parent.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, _CONTAINERS) or _holds_container(child):
                walk(path, child)
            else:
                names.append(path)
    walk("", module)
    return names


def _holds_container(module: torch.nn.Module) -> bool:
    return any(isinstance(inner, _CONTAINERS) and len(inner) > 0 for inner in module.modules())


def export_model(module: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes,
                 warn: bool = True) -> torch.export.ExportedProgram:
    """The whole forward as one graph. torch's warning that an LSTM sets its flat weights during export is its own
    business: the weights are the module's parameters all the same. Outputs of types torch cannot flatten (a
    Hugging Face model's DynamicCache while training) come back as None, with one warning naming them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*were assigned during export")
        try:
            return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes)
        except RuntimeError as error:
            if "which is not a known type" not in str(error):
                raise
        dropped = unsendable_outputs(module, args, kwargs)
        if not dropped:
            raise RuntimeError("the model returns a value torch.export cannot flatten")
        with _dropping(dropped.values()):
            program = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes)
            signature = program.module_call_graph[0].signature
            signature.out_spec = pytree.tree_structure(pytree.tree_unflatten(
                [object() for _ in range(signature.out_spec.num_leaves)], signature.out_spec))
    names = ", ".join(f"{path} ({kind.__name__})" for path, kind in dropped.items())
    if warn:
        warnings.warn(f"{type(module).__name__} returns {names}, which cannot travel between processes; the deployed "
                      "model returns None in its place (a cache is for generation: pass use_cache=False to not make "
                      "it)", stacklevel=5)
    return program


def shapes_only(module: torch.nn.Module, values) -> contextlib.AbstractContextManager:
    """Where an eager forward of a model on the meta device runs: on fake tensors, which libraries take for
    tracing, so that they skip the reads of values (a mask's .all()) that meta tensors cannot answer."""
    on_meta = any(t.is_meta for t in (*module.parameters(), *pytree.tree_leaves(values)) if isinstance(t, torch.Tensor))
    return FakeTensorMode(allow_non_fake_inputs=True) if on_meta else contextlib.nullcontext()


def unsendable_outputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, type]:
    """The model's outputs, by path, whose types torch's pytree does not know (one forward, leaving the model and
    torch's random stream as they were)."""
    with untouched(module), torch.no_grad(), shapes_only(module, (args, kwargs)):
        outputs = module(*args, **kwargs)
    found = {}
    for path, leaf in pytree.tree_flatten_with_path(outputs)[0]:
        if not isinstance(leaf, (torch.Tensor, int, float, bool, str, type(None))):
            name = ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
            found[name or "its output"] = type(leaf)
    return found


@contextlib.contextmanager
def _dropping(kinds):
    """Makes torch's pytree see `kinds` as holding nothing while the model is captured."""
    added = [kind for kind in dict.fromkeys(kinds) if kind not in pytree.SUPPORTED_NODES]
    for kind in added:
        pytree.register_pytree_node(kind, lambda _value: ([], None), lambda _leaves, _context: None,
                                    flatten_with_keys_fn=lambda _value: ([], None))
    try:
        yield
    finally:
        for kind in added:
            pytree._deregister_pytree_node(kind)


def cut(program: torch.export.ExportedProgram, module: torch.nn.Module) -> CutGraph:
    """Cuts a whole-model graph into units (see the module docstring)."""
    return _Cutter(program, module).result()


class _Cutter:
    """Assigns every operation to a unit, then builds each unit's graph module and the values between them."""

    def __init__(self, program: torch.export.ExportedProgram, module: torch.nn.Module):
        self.program = program
        self.module = module
        self.candidates = set(unit_names(module))
        self.aliases = {key: group for group in shared_keys(module) for key in group}
        self.builders: list[_UnitBuilder] = []
        signature = program.graph_signature
        self.state: dict[str, str] = {}  # placeholder name -> state-dict key
        self.inputs: list[torch.fx.Node] = []
        nodes = {node.name: node for node in program.graph.nodes}
        for spec in signature.input_specs:
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                self.state[spec.arg.name] = spec.target  # a constant (a tensor the forward makes) as a buffer
            elif spec.kind == InputKind.USER_INPUT:
                self.inputs.append(nodes[spec.arg.name])
            else:
                raise InvalidArgument(f"the model's forward takes {spec.target!r} ({spec.kind.name}), which a "
                                      "deployment cannot hold; register it with register_buffer")
        if not self.inputs or not all(_is_tensor(node) for node in self.inputs):
            raise InvalidArgument("the model's inputs must be tensors (at least one), each its own argument")
        output = next(node for node in program.graph.nodes if node.op == "output")
        self.leaves = list(output.args[0])
        for spec in signature.output_specs:
            if spec.kind != OutputKind.USER_OUTPUT:  # the training graph updates buffers in place instead
                raise InvalidArgument(f"the model's forward changes {spec.target!r} in a way a deployed model "
                                      "cannot follow")
        self.outputs = list(dict.fromkeys(n for n in self.leaves if isinstance(n, torch.fx.Node)))
        # Outputs after the first leave the last unit under names of their own: one may also be a value an earlier
        # unit passes on by its node's name (node names have no dots).
        self.output_names = tuple(f"output.{k}" for k in range(1, len(self.outputs)))
        if not self.outputs or not all(_is_tensor(n) for n in self.outputs):
            raise InvalidArgument("the model must return a tensor, or tensors in a tuple, list or dict (with plain "
                                  "constants beside them)")
        self.unit_of = self._assign()

    def _assign(self) -> dict[torch.fx.Node, int]:
        """Each operation's unit: the unit of the module that ran it, never earlier than the operation before."""
        order: list[str] = []
        unit_of: dict[torch.fx.Node, int] = {}
        current = 0
        for node in self.program.graph.nodes:
            if node.op != "call_function" or _is_symbolic(node):  # sizes: each unit reads its own
                continue
            name = self._unit_name(node)
            if name is not None and name not in order:
                order.append(name)
            if name is not None:
                current = max(current, order.index(name))
            unit_of[node] = current
        self.order = order or ["(model)"]
        return unit_of

    def _unit_name(self, node: torch.fx.Node) -> str | None:
        stack = node.meta.get("nn_module_stack") or {}
        for path, _type in stack.values():
            if path in self.candidates:
                return path
        return None

    def result(self) -> CutGraph:
        count = len(self.order)
        main_input, extra_inputs = self.inputs[0], self.inputs[1:]
        produced = dict(self.unit_of)
        produced[main_input] = 0
        produced.update({node: -1 for node in extra_inputs})  # from the SDK: read by name wherever needed
        consumers: dict[torch.fx.Node, set[int]] = {}
        for node, unit in self.unit_of.items():
            for used in _tensor_args(node):
                if used in produced and produced[used] != unit:
                    consumers.setdefault(used, set()).add(unit)
        for node in self.outputs:  # the last unit returns every output, passing on those made before it
            if produced.get(node, 0) != count - 1:
                consumers.setdefault(node, set()).add(count - 1)
        crossing = [node for node in self.program.graph.nodes if node in consumers]
        mains = self._mains(count, crossing, produced, consumers)
        modules, wirings, varying = [], [], []
        for unit in range(count):
            main_in = mains[unit - 1] if unit else main_input
            incoming = [n for n in crossing if unit in consumers[n] and n is not main_in]
            if unit == count - 1:
                outgoing = self.outputs[1:]
            else:
                outgoing = [n for n in crossing if produced[n] == unit and (n is not mains[unit]
                                                                             or consumers[n] - {unit + 1})]
            modules.append(self._unit_module(unit, main_in, incoming, mains[unit], outgoing))
            saved = self.output_names if unit == count - 1 else tuple(n.name for n in outgoing)
            wirings.append(Wiring(tuple(n.name for n in incoming), saved))
            varying.append(tuple(_varying(n) for n in (main_in, *incoming)))
        self._check_buffers()
        descriptions = [f"{name} ({self._type_name(name)})" for name in self.order]
        named = dict(zip(self.outputs[1:], self.output_names))
        leaves = [("main", None) if leaf is self.outputs[0] else ("output", named[leaf])
                  if isinstance(leaf, torch.fx.Node) else ("constant", leaf) for leaf in self.leaves]
        return CutGraph(list(self.order), modules, wirings, varying, descriptions, [n.name for n in self.inputs],
                        list(self.output_names), leaves, self.program.call_spec.out_spec,
                        {node.name: self._limits(node) for node in self.inputs},
                        {key: value for key, value in self.program.constants.items()
                         if isinstance(value, torch.Tensor) and key in self.state.values()},
                        [builder.keys for builder in self.builders])

    def _limits(self, node: torch.fx.Node) -> dict[int, int]:
        """The dims of a model input that may not grow past a size (a sequence length's max in dynamic_shapes, or
        what the forward asserted): the shards' graphs no longer check it."""
        limits = {}
        for dim, size in enumerate(node.meta["val"].shape):
            if isinstance(size, torch.SymInt) and size.node.expr in self.program.range_constraints:
                upper = self.program.range_constraints[size.node.expr].upper
                if isinstance(upper, sympy.Integer):
                    limits[dim] = int(upper)
        return limits

    def _mains(self, count: int, crossing: list, produced: dict, consumers: dict) -> list[torch.fx.Node]:
        """Per unit, the value it hands the next unit as the main input: one the next unit reads, floating-point
        if any (its gradient comes back that way); the last unit's is the model's output."""
        mains = []
        for unit in range(count - 1):
            ours = [n for n in crossing if produced[n] == unit]
            ranked = sorted(ours, key=lambda n: (unit + 1 not in consumers[n], not _is_float(n)))
            if not ranked:
                raise InvalidArgument(f"the model's unit {self.order[unit]!r} produces nothing a later part reads")
            mains.append(ranked[0])
        mains.append(self.outputs[0])
        return mains

    def _type_name(self, name: str) -> str:
        try:
            return type(self.module.get_submodule(name)).__name__
        except AttributeError:
            return "operations"

    def _unit_module(self, unit: int, main_in: torch.fx.Node, incoming: Sequence[torch.fx.Node],
                     main_out: torch.fx.Node, outgoing: Sequence[torch.fx.Node]) -> torch.fx.GraphModule:
        """The unit as a graph module: forward(x, *incoming) -> main_out, or (main_out, *outgoing)."""
        builder = _UnitBuilder(self, unit)
        builder.take(main_in, "x")
        for node in incoming:
            builder.take(node, node.name)
        for node in self.program.graph.nodes:
            if self.unit_of.get(node) == unit:
                builder.copy(node)
        self.builders.append(builder)
        return builder.finish([main_out, *outgoing])

    def _check_buffers(self) -> None:
        """A buffer changed in one unit and read in another would differ between the stages holding it."""
        for builder in self.builders:
            for key in builder.written:
                readers = [self.order[b.unit] for b in self.builders if key in b.read and b is not builder]
                if readers:
                    raise InvalidArgument(f"the model changes buffer {key!r} in {self.order[builder.unit]!r} and "
                                          f"reads it in {readers[0]!r}; a buffer must be changed and read within "
                                          "one submodule")

    def key_in(self, key: str, unit: int) -> str:
        """A tied weight by the name it has inside the unit (an LM head's own, not the embedding's it is tied to)."""
        inside = [alias for alias in self.aliases.get(key, ()) if alias.startswith(self.order[unit] + ".")]
        return inside[0] if inside else key


class _UnitBuilder:
    """One unit's graph, built by copying the whole graph's operations; weights and sizes are fetched as needed."""

    def __init__(self, cutter: _Cutter, unit: int):
        self.cutter, self.unit = cutter, unit
        self.graph = torch.fx.Graph()
        self.holder = torch.nn.Module()  # the graphs its higher-order operators run; its weights, once finished
        self.weights: dict[str, tuple[torch.Tensor, bool]] = {}  # by model key: the tensor, whether a parameter
        self.keys: dict[str, str] = {}  # the weights' names in the unit -> their model keys, once finished
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.read: set[str] = set()     # the whole graph's keys of the weights the unit uses
        self.written: set[str] = set()  # those of them it changes in place

    def take(self, node: torch.fx.Node, name: str) -> None:
        """An input of the unit, standing for `node` of the whole graph. Inputs are passed by position, so a
        name taken already (a model input called x, read again beside the main input "x") gets a suffix."""
        taken = {other.target for other in self.graph.nodes if other.op == "placeholder"}
        while name in taken:
            name = f"{name}_"
        self.env[node] = self.graph.placeholder(name)
        self.env[node].meta = dict(node.meta)

    def copy(self, node: torch.fx.Node) -> None:
        self._copy_written_inputs(node)
        self.env[node] = self.graph.node_copy(node, self.resolve)
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable and node.args and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0].name in self.cutter.state:
            self.written.add(self.cutter.state[node.args[0].name])  # a running statistic, a counter

    def _copy_written_inputs(self, node: torch.fx.Node) -> None:
        """An in-place operation on a value the unit receives (torchvision's `relu(inplace=True)` on a block's
        input) writes into a copy: the unit's inputs belong to its caller, as they would in one process."""
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        for position, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
            copy = self.env.get(value) if isinstance(value, torch.fx.Node) else None
            if copy is not None and copy.op == "placeholder":
                clone = self.graph.call_function(torch.ops.aten.clone.default, (copy,))
                clone.meta = dict(copy.meta)
                self.env[value] = clone

    def finish(self, results: Sequence[torch.fx.Node]) -> torch.fx.GraphModule:
        values = [self.env[node] for node in results]
        self.graph.output(values[0] if len(values) == 1 else tuple(values))
        self.keys = self._local_names()
        local = {key: name for name, key in self.keys.items()}
        for node in self.graph.nodes:
            if node.op == "get_attr" and node.target in self.weights:
                node.target = local[node.target]
        for key, (tensor, is_parameter) in self.weights.items():
            _register(self.holder, local[key], tensor, is_parameter)
        return torch.fx.GraphModule(self.holder, self.graph)

    def _local_names(self) -> dict[str, str]:
        """Names the unit's weights by their paths inside it (`attn.c_attn.weight` for a block's own), so that
        identical blocks capture to the same program; a weight from elsewhere keeps its model key. Should two names
        meet, every weight keeps its model key."""
        prefix = self.cutter.order[self.unit] + "."
        names = {key.removeprefix(prefix): key for key in self.weights}
        taken = {name for name, _ in self.holder.named_children()}
        if len(names) < len(self.weights) or any(name.split(".")[0] in taken for name in names):
            names = {key: key for key in self.weights}
        return names

    def resolve(self, arg: torch.fx.Node):
        """What stands for `arg` in the unit: a copy made already, a weight, a graph a higher-order operator runs,
        or a size read again here."""
        if arg in self.env:
            return self.env[arg]
        if arg.name in self.cutter.state:
            self.env[arg] = self._weight(self.cutter.state[arg.name])
        elif arg.op == "get_attr":  # a graph a higher-order operator runs (a cond's branch): the unit's own copy
            self.holder.add_module(arg.target, getattr(self.cutter.program.graph_module, arg.target))
            self.env[arg] = self.graph.get_attr(arg.target)
        elif _is_symbolic(arg):
            value = arg.meta["val"]
            if isinstance(value, (int, float, bool)):
                return value  # a size the capture fixed: a constant in every unit
            self.env[arg] = self._size(arg)
        else:
            raise InvalidArgument(f"cannot cut the model between parts: {arg.name} crosses a cut and is not a "
                                  "tensor")
        return self.env[arg]

    def _weight(self, key: str) -> torch.fx.Node:
        """A get_attr of the weight by its model key, renamed when the unit is finished."""
        self.read.add(key)
        here = self.cutter.key_in(key, self.unit)
        program = self.cutter.program
        # a non-persistent buffer's value is among the program's constants
        value = program.state_dict[key] if key in program.state_dict else program.constants[key]
        self.weights.setdefault(here, (value, key in program.graph_signature.parameters))
        return self.graph.get_attr(here)

    def _size(self, arg: torch.fx.Node) -> torch.fx.Node:
        """A size computed in another unit, read again from a tensor this unit has: sizes never cross a cut."""
        wanted = str(arg.meta["val"])
        for source, copy in list(self.env.items()):
            value = source.meta.get("val")
            sizes = value.shape if isinstance(value, torch.Tensor) else ()
            for dim, size in enumerate(sizes):
                if not isinstance(size, int) and str(size) == wanted:
                    return self.graph.call_function(torch.ops.aten.sym_size.int, (copy, dim))
        if arg.op == "call_function" and arg.target in _SIZE_ARITHMETIC:
            return self.graph.node_copy(arg, self.resolve)
        raise InvalidArgument(f"cannot cut the model between parts: a size ({wanted}) is needed after a cut and no "
                              "tensor there has it")


_SIZE_ARITHMETIC = (operator.mul, operator.add, operator.sub, operator.floordiv, torch.sym_max, torch.sym_min)


def structure(module: torch.nn.Module | None) -> tuple | None:
    """What capturing a unit graph depends on besides its weights' values: its operations in order, with their
    arguments (other nodes by position, not name), each value's shape and dtype, and its weights' names, shapes,
    dtypes and kinds. Units of equal structure export to the same program. None for a module that is not a graph."""
    if not isinstance(module, torch.fx.GraphModule):
        return None
    position: dict[torch.fx.Node, int] = {}
    rows = []
    for node in module.graph.nodes:
        position[node] = len(position)
        arguments = torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: f"%{position[arg]}")
        rows.append((node.op, _target_structure(module, node), repr(arguments), _value_structure(node.meta.get("val"))))
    return tuple(rows)


def _target_structure(module: torch.fx.GraphModule, node: torch.fx.Node):
    if node.op == "placeholder":
        return None  # inputs are passed by position
    if node.op != "get_attr":
        return str(node.target)
    held = operator.attrgetter(node.target)(module)
    if isinstance(held, torch.Tensor):
        return node.target, _value_structure(held), isinstance(held, torch.nn.Parameter)
    return structure(held) or ("unknown", id(held))  # a graph a higher-order operator runs; anything else: unique


def _value_structure(value) -> str:
    return repr(pytree.tree_map(lambda v: (tuple(str(size) for size in v.shape), str(v.dtype), v.requires_grad)
                                if isinstance(v, torch.Tensor) else v, value))


def shared_keys(module: torch.nn.Module) -> list[list[str]]:
    """The state-dict keys of each tensor held under several keys (tied weights), in the model's order."""
    keys: dict[int, list[str]] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for key, tensor in named:
        keys.setdefault(id(tensor), []).append(key)
    return [group for group in keys.values() if len(group) > 1]


def _register(holder: torch.nn.Module, key: str, tensor: torch.Tensor, is_parameter: bool) -> None:
    """Puts a weight into the unit's module at its state-dict path, as a Parameter or a buffer."""
    *path, leaf = key.split(".")
    owner = holder
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    if leaf in owner._parameters or leaf in owner._buffers:
        return
    if is_parameter:
        owner.register_parameter(leaf, tensor if isinstance(tensor, torch.nn.Parameter)
                                 else torch.nn.Parameter(tensor, requires_grad=tensor.requires_grad))
    else:
        owner.register_buffer(leaf, tensor)


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: found.append(arg))
    return [arg for arg in found if _is_tensor(arg) or arg.op == "placeholder"]


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _is_symbolic(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _is_float(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _varying(node: torch.fx.Node) -> tuple[int, ...]:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return ()
    return tuple(dim for dim, size in enumerate(value.shape) if not isinstance(size, int))
