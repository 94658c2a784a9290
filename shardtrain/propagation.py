"""Shapes checked before a program runs: every operator re-run on fake tensors must give what the program declares.

A serialized program declares each value's dtype and (symbolic) shape. A hostile one can declare shapes its
operators would never produce, so that a later operator reads past a tensor. Before a shard runs a program it
re-runs every operator on fake tensors (no memory, no data) in the program's own shape environment: each
result must agree with the declaration, and an operator whose meta kernel refuses its arguments is refused.
An operator whose meta kernel cannot run on symbolic sizes (an LSTM) is left to its own argument checks when
it runs: the rule of shardtrain/operators.py admits only operators that check them. A higher-order operator (a
cond) is re-run whole: the graphs it carries run on the fake tensors it is given, so their operators are checked
on the sizes they would really get, and its results must agree with the declaration.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch._guards import detect_fake_mode
from torch._subclasses import fake_tensor
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, statically_known_true, sym_eq

from shardtrain.errors import InvalidArgument


# What fake tensors raise for an operator they cannot run here, as opposed to one that refuses its arguments.
_UNCHECKABLE = (NotImplementedError, fake_tensor.UnsupportedOperatorException, fake_tensor.DynamicOutputShapeException,
                fake_tensor.DataDependentOutputException, GuardOnDataDependentSymNode)


_PASSED: OrderedDict[bytes, None] = OrderedDict()  # digests of programs that passed: a shard measures a layer,
PASSED_KEPT = 4096                                   # then loads it, and checks its program once


def check_program_shapes(digest: bytes, graph: torch.fx.Graph) -> None:
    """check_shapes, once per program: `digest` names the serialized program the graph was built from."""
    if digest in _PASSED:
        _PASSED.move_to_end(digest)
        return
    check_shapes(graph)
    _PASSED[digest] = None
    if len(_PASSED) > PASSED_KEPT:
        _PASSED.popitem(last=False)


def check_shapes(graph: torch.fx.Graph) -> None:
    """InvalidArgument naming the first node whose recomputed dtype or shape differs from its declared one."""
    declared = [node.meta.get("val") for node in graph.nodes]
    mode = detect_fake_mode([value for value in declared if isinstance(value, torch.Tensor)])
    if mode is None:
        return  # a graph without tensors computes nothing to check
    with mode:
        for node in graph.nodes:
            if node.op == "call_function" and isinstance(node.target, _OPERATORS):
                _check_node(node)


# A higher-order operator re-runs the graphs it carries on fake tensors: each of their operators is checked by its
# own meta kernel on the sizes it is actually given.
_OPERATORS = (torch._ops.OpOverload, torch._ops.HigherOrderOperator)


def _check_node(node: torch.fx.Node) -> None:
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _declared)
    try:
        result = node.target(*args, **kwargs)
    except _UNCHECKABLE:
        return
    except Exception as error:  # a meta kernel refusing its arguments raises whatever it raises
        if "symbolic sizes" in str(error):
            return
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise InvalidArgument(f"captured program: {node.target} ({node.name}) refuses the shapes the program "
                              f"gives it: {first}") from None
    want = node.meta.get("val")
    results = result if isinstance(result, (tuple, list)) else (result,)
    wants = want if isinstance(want, (tuple, list)) else (want,)
    for got, expected in zip(results, wants):
        if isinstance(expected, torch.Tensor) and not _agrees(got, expected):
            raise InvalidArgument(f"captured program: {node.target} ({node.name}) computes "
                                  f"{_describe(got)} where the program declares {_describe(expected)}")


def _declared(arg: torch.fx.Node):
    """What a node's argument is while shapes are checked: its declared value, or the graph a get_attr fetches."""
    if arg.op == "get_attr":
        return getattr(arg.graph.owning_module, arg.target)
    return arg.meta.get("val")


def _agrees(got, expected: torch.Tensor) -> bool:
    return isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.dim() == expected.dim() and all(
        _same_size(a, b) for a, b in zip(got.shape, expected.shape))


def _same_size(a, b) -> bool:
    """Equal sizes: the same integer or expression as written (cheap), else equal in the shape environment."""
    return (a == b) if isinstance(a, int) and isinstance(b, int) else (
        str(a) == str(b) or statically_known_true(sym_eq(a, b)))


def _describe(value) -> str:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
