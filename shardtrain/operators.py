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

MAX_NODES = 50_000  # operator calls in one layer's graph


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
    """InvalidArgument unless every node calls an allowed operator and writes only to buffers or its own results."""
    nodes = graph_module["graph"]["nodes"]
    if len(nodes) > MAX_NODES:
        raise InvalidArgument(f"captured program has {len(nodes)} operator calls; at most {MAX_NODES} are allowed")
    origin = _input_origins(graph_module["signature"]["input_specs"])
    for node in nodes:
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
