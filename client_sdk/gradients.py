"""The gradients of a deployed model's parameters, as `RemoteParameter.grad`: torch.nn.utils.clip_grad_norm_,
clip_grad_value_ and code written like them run on the remote parameters, their gradients never leaving the shards.

A `RemoteGradient` is a tensor of the parameter's shape and dtype that holds no values here. The operations such
code applies to gradients are taken over (its per-gradient norms, scaling and clamping in place): a norm is asked
of the shard that holds the gradient, all of a model's at once; an in-place change is kept and sent with the next
GradientNorm or Step, where the shards apply it in order. Any other operation is refused, naming what works.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import torch

from shardtrain.errors import InvalidArgument
from shardtrain.v1 import shard_pb2

# (norm type, {stage: [GradientEdit]}, {stage: [parameter name]}) -> {parameter name: its gradient's norm}
FetchNorms = Callable[[float, dict[int, list], dict[int, list[str]]], dict[str, float]]

_SCALES = {torch.Tensor.mul_, torch._foreach_mul_}
_CLAMPS = {torch.Tensor.clamp_, torch.Tensor.clamp_min_, torch.Tensor.clamp_max_, torch._foreach_clamp_min_,
           torch._foreach_clamp_max_}
_NORMS = {torch.linalg.vector_norm, torch._foreach_norm, torch.Tensor.norm, torch.norm}
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
             torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__len__}
_SUPPORTED = ("torch.nn.utils.clip_grad_norm_ and clip_grad_value_; on a .grad: torch.linalg.vector_norm(g, p), "
              "g.norm(p), g.mul_(x), g.clamp_(min, max) and their torch._foreach_ forms")


class RemoteGradients:
    """The gradient edits a script made since the shards last heard, and the norms it asked for since the
    gradients last changed (a backward, zero_grad or a step), for one deployed model."""

    def __init__(self, holders: dict[str, list[int]], fetch: FetchNorms, loss_scale: Callable[[], float],
                 present: Callable[[], bool]):
        self.present = present  # whether the model has gradients (a backward since the last zero_grad)
        self._holders = holders  # parameter name -> the stages holding it (a tied weight: several; the first counts)
        self._fetch = fetch
        self._loss_scale = loss_scale  # fp16: the shards' gradients are the scaled loss's
        self._edits: list[shard_pb2.GradientEdit] = []
        self._norms: dict[float, dict[str, float]] = {}

    def changed(self) -> None:
        """The shards' gradients changed: norms asked for before are stale."""
        self._norms.clear()

    def cleared(self) -> None:
        """The shards' gradients are gone (zero_grad, a planned step): edits of them are moot, norms stale."""
        self._edits.clear()
        self._norms.clear()

    def take_edits(self) -> list[shard_pb2.GradientEdit]:
        """The edits not yet sent, for a Step (each stage applies those naming what it holds)."""
        edits, self._edits = self._edits, []
        return edits

    def take_edits_by_stage(self) -> dict[int, list[shard_pb2.GradientEdit]]:
        """The edits not yet sent, per stage that holds their parameter, for GradientNorm calls."""
        by_stage: dict[int, list] = {}
        for edit in self.take_edits():
            for stage in self._holders[edit.parameter]:
                by_stage.setdefault(stage, []).append(edit)
        return by_stage

    def norm(self, name: str, norm_type: float) -> float:
        """The p-norm of one parameter's gradient, as torch.linalg.vector_norm computes it; the first ask after a
        change fetches every parameter's at once (with the edits not yet sent), since clipping asks for all."""
        norm_type = float(norm_type)
        if self._edits:
            self._norms.clear()
        if norm_type not in self._norms:
            names: dict[int, list[str]] = {}
            for parameter, stages in self._holders.items():
                names.setdefault(stages[0], []).append(parameter)
            norms = self._fetch(norm_type, self.take_edits_by_stage(), names)
            scale = self._loss_scale()
            self._norms[norm_type] = {key: value / scale for key, value in norms.items()}
        return self._norms[norm_type][name]

    def scale(self, name: str, factor: float) -> None:
        self._edits.append(shard_pb2.GradientEdit(parameter=name, scale=factor))

    def clamp(self, name: str, low: float, high: float) -> None:
        scale = self._loss_scale()
        self._edits.append(shard_pb2.GradientEdit(parameter=name, clamp=shard_pb2.Interval(low=low * scale,
                                                                                             high=high * scale)))


class RemoteGradient(torch.Tensor):
    """The gradient of one RemoteParameter, held by its shards. torch.nn.utils.clip_grad_norm_ and clip_grad_value_
    work on a list of these; their values are read with model.state_dict()'s weights after a step, not here."""

    @staticmethod
    def __new__(cls, name: str, shape: Sequence[int], dtype: torch.dtype, book: RemoteGradients):
        gradient = torch.zeros((), dtype=dtype).expand(tuple(shape)).as_subclass(cls)
        gradient._name = name
        gradient._book = book
        return gradient

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"RemoteGradient({self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__" or func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _NORMS:
            return _norms(func, args, kwargs)
        if func in _SCALES:
            return _scale(func, args, kwargs)
        if func in _CLAMPS:
            return _clamp(func, args, kwargs)
        raise TypeError(f"{getattr(func, '__name__', func)} on a RemoteParameter's .grad: the gradient stays on the "
                        f"shards, and what runs there is {_SUPPORTED}")


def _gradients(value) -> list[RemoteGradient]:
    gradients = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(gradient, RemoteGradient) for gradient in gradients):
        raise TypeError("an operation mixes a RemoteParameter's .grad with local tensors; the gradients stay on the "
                        f"shards, and what runs there is {_SUPPORTED}")
    return gradients


def _number(value, what: str) -> float:
    if isinstance(value, torch.Tensor) and not isinstance(value, RemoteGradient) and value.numel() == 1:
        return value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{what} of a RemoteParameter's .grad takes a number or a one-element tensor, got "
                    f"{type(value).__name__}")


def _norms(func, args, kwargs):
    gradients = _gradients(args[0])
    names = ("ord", "dtype") if func is torch._foreach_norm else ("ord", "dim", "keepdim", "dtype")
    given = dict(zip(names, args[1:]))
    given.update({("ord" if key == "p" else key): value for key, value in kwargs.items()})
    ord_ = given.pop("ord", "fro" if func in (torch.Tensor.norm, torch.norm) else 2.0)
    ord_ = 2.0 if ord_ == "fro" else ord_
    extra = {key: value for key, value in given.items() if value not in (None, False)}
    if extra or not isinstance(ord_, numbers.Real):
        raise TypeError(f"a norm of a RemoteParameter's .grad is of the whole gradient, with a number p; got "
                        f"p={ord_!r} {extra or ''}")
    values = [torch.tensor(g._book.norm(g._name, float(ord_)), dtype=g.dtype) for g in gradients]
    return values if func is torch._foreach_norm else values[0]


def _each(value, count: int) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count:
        raise InvalidArgument(f"{len(values)} values for {count} gradients")
    return values


def _scale(func, args, kwargs):
    gradients = _gradients(args[0])
    factor = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("scalar", kwargs.get("scalars")))
    for gradient, each in zip(gradients, _each(factor, len(gradients))):
        gradient._book.scale(gradient._name, _number(each, "a multiplication"))
    return args[0]


def _clamp(func, args, kwargs):
    gradients = _gradients(args[0])
    rest = list(args[1:])
    if func in (torch.Tensor.clamp_min_, torch._foreach_clamp_min_):
        low, high = kwargs.get("min", kwargs.get("scalar", kwargs.get("scalars", rest[0] if rest else None))), None
    elif func in (torch.Tensor.clamp_max_, torch._foreach_clamp_max_):
        low, high = None, kwargs.get("max", kwargs.get("scalar", kwargs.get("scalars", rest[0] if rest else None)))
    else:
        low = kwargs.get("min", rest[0] if rest else None)
        high = kwargs.get("max", rest[1] if len(rest) > 1 else None)
    for gradient, each_low, each_high in zip(gradients, _each(low, len(gradients)), _each(high, len(gradients))):
        gradient._book.clamp(gradient._name, -math.inf if each_low is None else _number(each_low, "a clamp"),
                             math.inf if each_high is None else _number(each_high, "a clamp"))
    return args[0]
