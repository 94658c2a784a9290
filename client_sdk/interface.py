"""How a deployed model is called and what it returns: its forward's arguments, bound as the local model binds
them, and its outputs rebuilt in the model's own structure (a tensor, a tuple, a dict)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from shardtrain.errors import InvalidArgument


@dataclass(frozen=True)
class Interface:
    """The tensor arguments a deployment takes (the first travels as the main input, the others by name) and the
    outputs it returns (the main output first, the others by name, rebuilt with `out_spec` around constants)."""

    signature: inspect.Signature | None = None  # None: one tensor in, one out (a Sequential, a layer list)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    leaves: tuple = ()  # per flat output: ("main", None), ("output", name) or ("constant", value)
    out_spec: object = None
    limits: dict = field(default_factory=dict)  # per input, {dim: the largest size the deployment takes}

    @property
    def extra_inputs(self) -> tuple[str, ...]:
        return self.inputs[1:]

    @property
    def is_plain(self) -> bool:
        """One tensor in and one out (constants beside it aside): what the explicit async API takes."""
        return len(self.inputs) <= 1 and not self.outputs

    def bind(self, args: Sequence, kwargs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(main input, other inputs by name) from a call's arguments, as the model's forward would take them."""
        if self.signature is None:
            if len(args) != 1 or kwargs:
                raise InvalidArgument(f"this model takes one tensor, got {len(args)} arguments and keywords "
                                      f"{sorted(kwargs)}")
            return _tensor(args[0], "the input"), {}
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as error:
            raise InvalidArgument(f"the model's forward{self.signature}: {error}") from None
        # what the call passes (defaults were the graph's at deploy too); None stands for an argument left out
        given = {name: value for name, value in bound.arguments.items() if value is not None}
        for name in sorted(given.keys() - set(self.inputs)):
            raise InvalidArgument(f"argument {name!r} was not given when the model was deployed, so its graph "
                                  f"keeps its default; deploy with it in the example inputs (deployed with "
                                  f"{list(self.inputs)})")
        missing = [name for name in self.inputs if name not in given]
        if missing:
            raise InvalidArgument(f"the deployed model takes {list(self.inputs)}, as its example had them; "
                                  f"{missing} missing")
        values = {name: _tensor(given[name], f"argument {name!r}") for name in self.inputs}
        for name, limits in self.limits.items():
            for dim, largest in limits.items():
                size = values[name].shape[dim] if dim < values[name].dim() else 0
                if size > largest:
                    raise InvalidArgument(f"argument {name!r} has size {size} in dim {dim}; the deployed model takes at "
                                          f"most {largest} there (the model's dynamic_shapes, or a check in its forward, "
                                          "when it was deployed)")
        return values[self.inputs[0]], {name: values[name] for name in self.extra_inputs}

    def output_name(self, which) -> str:
        """The name the shards give output `which` (an index into the model's tuple or a key of its dict; 0 for a
        model of one output): "output" for the main output, or one of `outputs`."""
        if self.out_spec is None:
            if which != 0:
                raise InvalidArgument(f"this model returns one tensor: its loss output is 0, got {which!r}")
            return "output"
        positions = pytree.tree_unflatten(list(range(len(self.leaves))), self.out_spec)
        try:
            position = positions[which]
        except (KeyError, IndexError, TypeError):
            raise InvalidArgument(f"the model returns {_shape_of(positions)}: it has no output {which!r}") from None
        if not isinstance(position, int):
            raise InvalidArgument(f"output {which!r} of the model is {_shape_of(position)}, not one tensor")
        kind, value = self.leaves[position]
        if kind == "constant":
            raise InvalidArgument(f"output {which!r} was the constant {value!r} when the model was deployed, not a "
                                  "tensor: deploy with the example inputs that make the model compute its loss "
                                  "(its targets)")
        return "output" if kind == "main" else value

    def build(self, main: torch.Tensor, extras: Sequence[torch.Tensor]):
        """The model's output from the main output and the others (in `outputs` order)."""
        if self.out_spec is None:
            return main
        named = dict(zip(self.outputs, extras))
        flat = [main if kind == "main" else named[value] if kind == "output" else value for kind, value in self.leaves]
        return pytree.tree_unflatten(flat, self.out_spec)


def _tensor(value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidArgument(f"{what} must be a tensor, got {type(value).__name__}")
    return value


def _shape_of(positions) -> str:
    """A model output's structure, for messages: tuple(2), dict('logits', 'loss'), ..."""
    if isinstance(positions, dict):
        return f"a dict of {list(positions)}"
    if isinstance(positions, (tuple, list)):
        return f"a {type(positions).__name__} of {len(positions)}"
    return "one tensor"
