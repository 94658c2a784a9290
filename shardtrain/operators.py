"""What a shipped program may call: a rule over aten operators' names and schemas, not a hand-kept list.

A captured layer runs on a shard with the shard's privileges, so its graph may only compute on its own
tensors. Every node's target must be an aten operator (or Python arithmetic on sizes) that the rule admits:

- refused by name: operators that reach files, storages, the process, the random seed, other ranks, or that
  hand out uninitialised or re-pointed memory; backend kernels and sparse, quantized or nested layouts, whose
  constructors can skip their invariants;
- refused as internal: `_`-prefixed and `native_*` operators, which skip the argument checks of their public
  forms (a batch norm's running statistics of the wrong size read past them); torch.export writes the public
  forms, and the few internals it does write are vetted one by one below;
- refused by schema: a storage, stream or (required) generator argument, or a free-form string;
- refused by tag: operators that change a tensor's shape or strides in place;
- and an operator that writes into a tensor may write only into the layer's own buffers or into tensors the
  graph itself made, never into its inputs or parameters (a view of them counts as them).

Of the higher-order operators, those export writes for `torch.cond`, `torch.no_grad()`/`enable_grad()` and
`torch.autocast` regions are admitted: each only runs graphs it carries on the tensors it is given, and those
graphs are checked node by node by the same rule, their inputs keeping the origins of the values passed in.
Every other higher-order operator is refused, each with its reason.

Everything is checked on the serialized program, before the deserializer builds anything; the shard then
propagates shapes through the built graph with fake tensors (shardtrain/capture.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from shardtrain.errors import InvalidArgument

# Python functions export writes for arithmetic on symbolic sizes (and getitem on multi-output operators).
ALLOWED_PYTHON = frozenset(f"_operator.{name}" for name in """
    getitem add sub mul floordiv truediv mod neg pos eq ne lt le gt ge and_ or_ not_
""".split())

# Refused by name, each pattern with the reason the refusal gives.
DENIED = (
    (re.compile(r"file|storage|save|load|print|pickle"), "reads or writes outside the computation"),
    (re.compile(r"seed|rng_state|c10d|distributed|record_stream|share_memory|pin_memory|is_pinned|cuda|"
                r"_sync|wait_tensor"),
     "reaches the process, its random seed, a device's streams or other processes"),
    (re.compile(r"empty|resize|^set_?$|^set_|set_data|as_strided|unsafe|data_ptr|^lift$"),
     "returns uninitialized memory or re-points a tensor's memory (zeros, zeros_like or new_zeros compute the "
     "same)"),
    (re.compile(r"sparse|quantiz|^q_|int_repr|nested|mkldnn|cudnn|miopen|mps|fbgemm|xnnpack|vulkan|onednn|"
                r"^indices$|^values$|crow_indices|col_indices|ccol_indices|row_indices|coalesce|to_dense|"
                r"to_padded"),
     "is a backend kernel or builds a sparse, quantized or nested tensor, whose invariants it may skip"),
)
# Internal operators torch.export writes for ordinary models, each checked like its public form.
VETTED_INTERNALS = {
    "_assert_tensor_metadata": "asserts an input's dtype and device",
    "_assert_scalar": "asserts a relation between sizes",
    "_assert_async": "asserts a one-element tensor is true",
    "_to_copy": "the functional form of Tensor.to",
    "_softmax": "softmax's kernel, which checks its dim",
    "_log_softmax": "log_softmax's kernel, which checks its dim",
    "_local_scalar_dense": "Tensor.item, which checks there is one element",
}
# String arguments that pick a mode of a pure computation (or word its assertion); any other is refused.
_MODE_STRINGS = frozenset({"approximate", "reduce", "rounding_mode", "padding", "equation", "side",
                           "interpolation", "mode", "padding_mode", "indexing", "UPLO", "ord",
                           "assert_msg", "driver", "norm", "memory_format"})
# Operators whose schema does not mark the running statistics they update (they write them all the same).
_UNMARKED_WRITES = {name: ("running_mean", "running_var") for name in ("batch_norm", "instance_norm")}
_TARGET = re.compile(r"torch\.ops\.aten\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)")

# Higher-order operators a shipped program may call: each runs the graphs it carries on its tensor operands.
HIGHER_ORDER = {
    "cond": "runs one of two graphs on its operands, chosen by a boolean tensor",
    "wrap_with_set_grad_enabled": "runs a graph with autograd switched on or off (torch.no_grad())",
    "wrap_with_autocast": "runs a graph under torch.autocast",
}
# Higher-order operators refused, each with the reason; any other gets the last one.
REFUSED_HIGHER_ORDER = {
    "while_loop": "runs its body a data-dependent number of times, which no limit bounds",
    "run_with_rng_state": "sets the random generator's state from a value it is given",
    "run_and_save_rng_state": "reads the random generator's state",
    "triton_kernel_wrapper_mutation": "runs a kernel given as source code, not a checked graph",
    "triton_kernel_wrapper_functional": "runs a kernel given as source code, not a checked graph",
    "auto_functionalized": "calls a custom operator, outside the aten operators the rule admits",
    "auto_functionalized_v2": "calls a custom operator, outside the aten operators the rule admits",
    "with_effects": "orders operators with side effects (printing, custom effects)",
    "flex_attention": "takes kernel options and score functions compiled for a backend",
    "call_torchbind": "calls a method of a script object",
    None: "is not one of the higher-order operators the rule admits "
          "(cond, wrap_with_set_grad_enabled, wrap_with_autocast)",
}
AUTOCAST_DEVICES = frozenset({"cpu", "cuda"})
_HIGHER_ORDER = re.compile(r"torch\.ops\.higher_order\.([A-Za-z0-9_]+)")
_OPERANDS = frozenset({"as_tensor", "as_tensors", "as_optional_tensors", "as_int", "as_ints", "as_sym_int",
                       "as_sym_ints", "as_float", "as_sym_float", "as_bool", "as_sym_bool", "as_none"})

MAX_NODES = 50_000  # operator calls in one layer's graph, those of the graphs inside higher-order operators included
MAX_DEPTH = 8       # graphs nested inside higher-order operators (a cond inside a cond's branch is two)


def refusal(packet: str, schema: torch.FunctionSchema | None, tags=()) -> str | None:
    """Why an aten operator may not run in a shipped program, or None if it may."""
    for pattern, reason in DENIED:
        if pattern.search(packet):
            return reason
    internal = packet.startswith("native_") or (packet.startswith("_") and not packet.startswith("__"))
    if internal and packet not in VETTED_INTERNALS:
        return ("is an internal operator that skips its public form's argument checks; call the public form "
                f"({packet.lstrip('_').removeprefix('native_')!r} or the torch.nn.functional function)")
    if torch.Tag.inplace_view in tags and packet != "detach_":  # detach_ changes only autograd's view of it
        return "changes a tensor's shape or strides in place"
    for argument in () if schema is None else (*schema.arguments, *schema.returns):
        kind = str(argument.type)
        if "Storage" in kind or "Stream" in kind or kind == "Generator":  # an optional generator is None here
            return f"takes a {kind} ({argument.name})"
        if kind.removesuffix("?") == "str" and argument.name not in _MODE_STRINGS:
            return f"takes a string argument {argument.name!r}"
    return None


def allowed(operator: torch._ops.OpOverload) -> bool:
    """True for an aten operator overload the rule admits."""
    return operator.namespace == "aten" and refusal(
        operator._schema.name.removeprefix("aten::"), operator._schema, operator.tags) is None


def resolve(target: str) -> torch._ops.OpOverload | None:
    """The aten operator a serialized node target names (None for an allowed Python function).

    InvalidArgument for anything else: a refused name, schema or tag, or a name torch does not know.
    """
    if target in ALLOWED_PYTHON:
        return None
    match = _TARGET.fullmatch(target)
    if match is None:
        raise InvalidArgument(f"captured program calls {target[:80]!r}; only aten operators "
                              f"and {sorted(ALLOWED_PYTHON)} may appear")
    packet, overload = match.groups()
    why = refusal(packet, None)
    if why is None:
        try:
            operator = getattr(getattr(torch.ops.aten, packet), overload)
        except (AttributeError, RuntimeError):
            raise InvalidArgument(f"captured program calls {target!r}, which this torch does not have") from None
        if not isinstance(operator, torch._ops.OpOverload):
            raise InvalidArgument(f"captured program calls {target!r}, which is not an operator")
        why = refusal(packet, operator._schema, operator.tags)
    if why is not None:
        raise InvalidArgument(f"captured program calls {target!r}, which {why}")
    return operator


def check_graph(graph_module: dict) -> None:
    """InvalidArgument unless every node, those in the graphs higher-order operators carry too, calls an allowed
    operator and writes only to buffers or its own results."""
    count = count_nodes(graph_module["graph"])
    if count > MAX_NODES:
        raise InvalidArgument(f"captured program has {count} operator calls; at most {MAX_NODES} are allowed")
    _check_nodes(graph_module["graph"], _input_origins(graph_module["signature"]["input_specs"]))


def count_nodes(graph: dict, depth: int = 0) -> int:
    """The operator calls of a serialized graph, with those of the graphs its higher-order operators carry."""
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"captured program nests graphs inside higher-order operators more than {MAX_DEPTH} "
                              "deep")
    return sum(1 + sum(count_nodes(inner["graph"], depth + 1) for inner in subgraphs(node))
               for node in graph["nodes"])


def subgraphs(node: dict) -> list[dict]:
    """The graphs a serialized node carries (a cond's two branches, a region's body), each {name, graph}."""
    return [entry["arg"]["as_graph"] for entry in node["inputs"] if "as_graph" in entry["arg"]]


def _check_nodes(graph: dict, origin: dict[str, str]) -> list[str]:
    """check_graph's rule over one graph whose inputs' origins are given; returns its outputs' origins."""
    for node in graph["nodes"]:
        higher = _HIGHER_ORDER.fullmatch(node["target"])
        if higher is not None:
            _check_higher_order(node, higher.group(1), origin)
            continue
        operator = resolve(node["target"])
        arguments = {entry["name"]: entry["arg"] for entry in node["inputs"]}
        for name in _written_arguments(operator):
            for tensor in _tensor_names(arguments.get(name)):
                if origin.get(tensor, "result") not in ("buffer", "result"):
                    raise InvalidArgument(f"captured program: {node['target']} writes into {tensor!r}, "
                                          f"a {origin[tensor]}; operators may write only into buffers "
                                          f"and the graph's own results")
        aliased = _aliased_argument(operator, node)
        root = "result" if aliased is None else next(
            (origin.get(t, "result") for t in _tensor_names(arguments.get(aliased))), "result")
        for output in node["outputs"]:
            for tensor in _tensor_names(output):
                origin[tensor] = root
    return [origin.get(tensor, "result") for tensor in _tensor_names(graph.get("outputs", []))]


def _check_higher_order(node: dict, name: str, origin: dict[str, str]) -> None:
    """An admitted higher-order operator with the arguments its kind takes; its graphs checked by the same rule,
    each input with the origin of the operand passed to it, its results with those of the graphs' outputs."""
    if name not in HIGHER_ORDER:
        why = REFUSED_HIGHER_ORDER.get(name, REFUSED_HIGHER_ORDER[None])
        raise InvalidArgument(f"captured program calls {node['target']!r}, which {why}")
    operands = _operands(node["target"], name, [entry["arg"] for entry in node["inputs"]])
    outputs = [_check_subgraph(node["target"], inner, operands, origin) for inner in subgraphs(node)]
    for position, tensor in enumerate(_tensor_names(node["outputs"])):
        kinds = [graph_outputs[position] for graph_outputs in outputs if position < len(graph_outputs)]
        origin[tensor] = min(kinds or ["result"], key=_STRICTEST.index)


def _check_subgraph(target: str, inner: dict, operands: list[dict], origin: dict[str, str]) -> list[str]:
    """One graph a higher-order operator carries, checked with its inputs' origins those of the operands passed to
    them; returns its outputs' origins. An error names the graph and the operator."""
    inputs = list(inner["graph"]["inputs"])
    if len(inputs) != len(operands):
        raise InvalidArgument(f"captured program: {target} passes {len(operands)} operands to graph "
                              f"{inner['name']!r}, which takes {len(inputs)}")
    passed = {inside: origin.get(outside, "result") for value, given in zip(inputs, operands)
              for inside, outside in zip(_tensor_names(value), _tensor_names(given))}
    try:
        return _check_nodes(inner["graph"], passed)
    except InvalidArgument as error:
        raise InvalidArgument(f"{error} (in graph {inner['name']!r} of {target})") from None


def _operands(target: str, name: str, arguments: list[dict]) -> list[dict]:
    """The operands a higher-order call passes its graphs, one per graph input, after checking the arguments its
    kind takes first (a predicate, a grad mode, autocast's device, dtype and flags) and its graphs."""
    leading, graphs = _LEADING[name]
    kinds = [next(iter(argument), None) for argument in arguments]
    expected = [*leading, *[{"as_graph"}] * graphs]
    if len(kinds) < len(expected) or any(kind not in allowed for kind, allowed in zip(kinds, expected)):
        raise InvalidArgument(f"captured program: {target} takes {[sorted(k) for k in expected]} then operands; "
                              f"got {kinds[:len(expected)]}")
    device = arguments[0].get("as_string") if name == "wrap_with_autocast" else None
    if device is not None and device not in AUTOCAST_DEVICES:
        raise InvalidArgument(f"captured program: {target} on device type {device[:40]!r}; expected one of "
                              f"{sorted(AUTOCAST_DEVICES)}")
    operands = []
    for argument, kind in zip(arguments[len(expected):], kinds[len(expected):]):
        if kind not in _OPERANDS:
            raise InvalidArgument(f"captured program: {target} passes a {kind} operand; expected tensors or numbers")
        if isinstance(argument[kind], list):  # a list of operands (cond's): one graph input each
            operands.extend({kind.removesuffix("s"): item} for item in argument[kind])
        else:
            operands.append(argument)
    return operands


# Per admitted higher-order operator: the argument kinds it takes before its graphs, and how many graphs.
_LEADING = {
    "cond": (({"as_tensor", "as_bool", "as_sym_bool"},), 2),
    "wrap_with_set_grad_enabled": (({"as_bool"},), 1),
    "wrap_with_autocast": (({"as_string", "as_none"}, {"as_scalar_type", "as_none"}, {"as_bool"},
                            {"as_bool", "as_none"}), 1),
}
_STRICTEST = ("parameter", "user input", "constant", "buffer", "result")  # a value that may be any takes the first


def _input_origins(input_specs: list[dict]) -> dict[str, str]:
    """Graph input name -> what it is: 'parameter', 'buffer', 'constant' or 'user input'."""
    kinds = {"parameter": "parameter", "buffer": "buffer", "user_input": "user input"}
    origins = {}
    for spec in input_specs:
        (kind, body), = spec.items()
        for tensor in _tensor_names(body.get("arg")):
            origins[tensor] = kinds.get(kind, "constant")
    return origins


def _written_arguments(operator: torch._ops.OpOverload | None) -> list[str]:
    if operator is None:
        return []
    written = [a.name for a in operator._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    return written + list(_UNMARKED_WRITES.get(operator._schema.name.removeprefix("aten::"), ()))


def _aliased_argument(operator: torch._ops.OpOverload | None, node: dict) -> str | None:
    """The argument whose memory the node's outputs share (a view or an in-place result), if any."""
    if operator is None:  # getitem shares its container's origin; arithmetic on sizes makes no tensors
        return node["inputs"][0]["name"] if node["target"] == "_operator.getitem" else None
    shared = set()
    for result in operator._schema.returns:
        if result.alias_info is not None:
            shared |= set(result.alias_info.before_set)
    for argument in operator._schema.arguments:
        if argument.alias_info is not None and shared & set(argument.alias_info.before_set):
            return argument.name
    return None


def _tensor_names(argument) -> Iterator[str]:
    """Names of the tensors a serialized argument refers to (as_tensor, as_tensors, optional ones)."""
    if isinstance(argument, dict):
        for key, value in argument.items():
            if key == "name" and isinstance(value, str):
                yield value
            elif key.startswith(("as_tensor", "as_optional_tensor", "arg")):
                yield from _tensor_names(value)
    elif isinstance(argument, list):
        for item in argument:
            yield from _tensor_names(item)
