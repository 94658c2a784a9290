"""Counting the bytes autograd saves for backward: a layer's or a stage's activation memory."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor


class SavedBytes:
    """While in effect, adds up the bytes of every tensor autograd saves, keeping each as it is.

    Weights that autograd saves (a Linear keeps its weight for the input's gradient) are not activations: tensors
    on the storage of the given weights are left out."""

    def __init__(self, weights: Iterable[torch.Tensor]):
        self.total = 0
        self._weights = {tensor.untyped_storage().data_ptr() for tensor in weights}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if is_traced(tensor):  # torch.cond traces its branches' backward as it runs: nothing of this run is saved
            return tensor
        if tensor.untyped_storage().data_ptr() not in self._weights:
            self.total += tensor.numel() * tensor.element_size()
        return tensor


def is_traced(tensor: torch.Tensor) -> bool:
    """True for a tensor of a trace (a fake or functional tensor), which has no memory of its own."""
    return isinstance(tensor, FakeTensor) or torch._is_functional_tensor(tensor) or \
        type(tensor).__name__ == "FunctionalTensor"


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
