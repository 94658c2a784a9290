"""The seed's layer-list format, `[(layer_class, kwargs, input_shape), ...]`, as a local nn.Module."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from shardtrain.capture import LayerAdapter
from shardtrain.errors import InvalidArgument
from shardtrain.residuals import Wiring, check_wiring, run_chain

_WIRING_KEYS = ("dependencies", "out_variables")


def _accepts(layer_class: type, name: str) -> bool:
    parameters = inspect.signature(layer_class.__init__).parameters
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _build(index: int, layer_class: type, kwargs: dict) -> torch.nn.Module:
    """Instantiates one entry; wiring keys reach the class only if its constructor takes them (as the seed's do)."""
    given = {k: v for k, v in kwargs.items() if k not in _WIRING_KEYS or _accepts(layer_class, k)}
    try:
        return layer_class(**given)
    except TypeError as error:
        raise InvalidArgument(f"layer {index}: {layer_class.__name__}(**{given}) failed: {error}") from None


class LayerList(torch.nn.Module):
    """Layers built from a seed layer list and run in order, with residuals passed by name.

    State-dict keys are `<index>.<name>`, as for an nn.Sequential of the same layers.
    """

    def __init__(self, spec: Sequence[tuple]):
        super().__init__()
        wirings, shapes = [], []
        for index, entry in enumerate(spec):
            if len(entry) != 3:
                raise InvalidArgument(f"layer {index}: expected (layer_class, kwargs, input_shape), got {entry!r}")
            layer_class, kwargs, input_shape = entry
            self.add_module(str(index), _build(index, layer_class, dict(kwargs)))
            wirings.append(Wiring(tuple(kwargs.get("dependencies", ())), tuple(kwargs.get("out_variables", ()))))
            shapes.append(input_shape)
        check_wiring(wirings)
        self.wirings = wirings
        self.input_shapes = shapes
        self._adapters = [LayerAdapter(layer, w.out_variables) for layer, w in zip(self.children(), wirings)]

    def example_input(self, batch: int = 2) -> torch.Tensor:
        """A random input of the first layer's declared shape, with `batch` rows."""
        shape = self.input_shapes[0]
        main = shape[0] if isinstance(shape, list) else shape
        return torch.randn(batch, *tuple(main)[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs every layer, as one process would."""
        return run_chain(self._adapters, self.wirings, x, {})
