"""The optimizer of a deployment as PyTorch users write it, and its stand-in on the client.

A deploy takes (class, kwargs), (class, param groups, kwargs) or an optimizer instance built over the model's
parameters (nanoGPT's configure_optimizers returns one). Each shard builds the same class over the parameters it
holds, group i being the same group everywhere. `model.optimizer` is an optimizer of that class whose param groups
hold the hyperparameters in force: a learning-rate scheduler bound to it, or a loop that sets group["lr"], changes
them, and the next step carries the change to every stage. Its step() and zero_grad() are the model's.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable

import torch

from shardtrain import optim
from shardtrain.errors import FailedPrecondition, InvalidArgument
from shardtrain.v1 import shard_pb2


def spec_for(optimizer, named: dict[str, torch.nn.Parameter]) -> shard_pb2.OptimizerSpec:
    """The OptimizerSpec of what a deploy was given, over the model's parameters `named` (by state-dict key)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return _from_instance(optimizer, named)
    if not isinstance(optimizer, tuple) or not 1 <= len(optimizer) <= 3 or \
            (len(optimizer) == 3 and not (isinstance(optimizer[1], list) and isinstance(optimizer[2], dict))) or \
            (len(optimizer) == 2 and not isinstance(optimizer[1], (list, dict))):
        raise InvalidArgument(f"optimizer takes (class, kwargs), (class, param groups, kwargs) or a torch.optim "
                              f"optimizer built over the model's parameters; got {type(optimizer).__name__}")
    groups = optimizer[1] if len(optimizer) >= 2 and isinstance(optimizer[1], list) else None
    kwargs = optimizer[-1] if len(optimizer) >= 2 and isinstance(optimizer[-1], dict) else {}
    name, kwargs_json = optim.encode(optimizer[0], kwargs)
    spec = shard_pb2.OptimizerSpec(name=name, kwargs_json=kwargs_json)
    if groups is not None:
        spec.groups.extend(_groups(groups, named))
    return spec


def _groups(groups: list, named: dict[str, torch.nn.Parameter]) -> list[shard_pb2.ParameterGroup]:
    """Param groups as torch.optim takes them, each "params" a list of state-dict keys or of the model's parameters,
    or a filter called with (key, parameter)."""
    taken: dict[str, int] = {}
    result = []
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise InvalidArgument(f"param group {index} must be a dict with \"params\", as torch.optim takes it")
        keys = _keys(group["params"], named, f"param group {index}")
        for key in keys:
            if key in taken:
                raise InvalidArgument(f"parameter {key!r} is in param groups {taken[key]} and {index}; "
                                      "torch.optim takes each parameter in one group")
            taken[key] = index
        options = {name: value for name, value in group.items() if name != "params"}
        result.append(shard_pb2.ParameterGroup(parameters=keys, options_json=_json(options, f"param group {index}")))
    return result


def _keys(params, named: dict[str, torch.nn.Parameter], what: str) -> list[str]:
    if callable(params):
        return [key for key, parameter in named.items() if params(key, parameter)]
    by_id = {id(parameter): key for key, parameter in named.items()}
    keys = []
    for item in list(params):
        key = item if isinstance(item, str) else by_id.get(id(item))
        if key not in named:
            raise InvalidArgument(f"{what} names {item if isinstance(item, str) else 'a tensor'} that is not a "
                                  f"parameter of the model (its parameters: {list(named)[:6]}...)")
        keys.append(key)
    return keys


def _from_instance(optimizer: torch.optim.Optimizer, named: dict[str, torch.nn.Parameter]) -> shard_pb2.OptimizerSpec:
    accepted = inspect.signature(type(optimizer)).parameters  # defaults may hold more (AdamW: Adam's own)
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    name, defaults_json = optim.encode(type(optimizer), _plain(defaults))
    spec = shard_pb2.OptimizerSpec(name=name, kwargs_json=defaults_json)
    spec.groups.extend(_groups(optimizer.param_groups, named))  # _groups makes each group's values plain
    return spec


def _plain(values: dict) -> dict:
    return {key: _plain_value(value) for key, value in values.items()}


def _plain_value(value):
    """A hyperparameter as JSON carries it: a tensor holding one number becomes that number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _json(options: dict, what: str) -> str:
    try:
        return json.dumps(_plain(options))
    except (TypeError, ValueError) as error:
        raise InvalidArgument(f"{what}: hyperparameters must be JSON numbers, strings, booleans or lists: "
                              f"{error}") from None


def client_optimizer(spec: shard_pb2.OptimizerSpec, step: Callable[[], None],
                     zero_grad: Callable[[], None]) -> torch.optim.Optimizer:
    """An optimizer of the deployed class and param groups (one placeholder tensor each), whose step() and
    zero_grad() are the model's: what an lr scheduler binds to, and whose groups hold the hyperparameters in force."""
    base = getattr(torch.optim, spec.name)

    class ClientOptimizer(base):
        def step(self, closure=None):
            if closure is not None:
                raise InvalidArgument("a closure cannot run on the shards: compute the loss, backward, then step()")
            step()

        def zero_grad(self, set_to_none: bool = True) -> None:
            zero_grad()

    ClientOptimizer.__name__ = ClientOptimizer.__qualname__ = base.__name__
    defaults = optim.json_options(spec.kwargs_json, "optimizer arguments")
    options = [optim.json_options(group.options_json, "param group options") for group in spec.groups] or [{}]
    return ClientOptimizer([{**group, "params": [torch.zeros(0, requires_grad=True)]} for group in options],
                           **defaults)


class Hyperparameters:
    """What the client's optimizer's groups hold, and whether the shards have it yet."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._optimizer = optimizer
        self._sent = self._current()

    def _current(self) -> list[dict]:
        return [{name: list(value) if isinstance(value, tuple) else _plain_value(value)
                 for name, value in group.items() if name != "params"} for group in self._optimizer.param_groups]

    def changes(self) -> str:
        """The groups' hyperparameters as JSON if they changed since last sent (then they count as sent), or ""."""
        current = self._current()
        if current == self._sent:
            return ""
        if len(current) != len(self._sent):
            raise FailedPrecondition(f"model.optimizer has {len(current)} param groups; the shards' optimizer has "
                                     f"{len(self._sent)} (groups cannot be added after deploying)")
        try:
            text = json.dumps(current)
        except (TypeError, ValueError) as error:
            raise InvalidArgument(f"model.optimizer's hyperparameters must be JSON numbers, strings, booleans or "
                                  f"lists: {error}") from None
        self._sent = current
        return text

    def all(self) -> str:
        """The groups' hyperparameters as JSON, whether sent or not (what a step run again must apply); "" if they do
        not fit in JSON (changes() says so)."""
        try:
            return json.dumps(self._current())
        except (TypeError, ValueError):
            return ""

    def restored(self) -> None:
        """The shards went back to snapshots, which hold the hyperparameters of their own time: the next changes()
        sends them all, though the last ones sent may equal them (a call made again after a roll-back)."""
        self._sent = [{} for _ in self._sent]

    def loaded(self, groups: list[dict]) -> None:
        """The shards took these groups' hyperparameters from a loaded optimizer state: the client's follow."""
        for group, state in zip(self._optimizer.param_groups, groups):
            group.update({name: value for name, value in state.items() if name != "params"})
        self._sent = self._current()

    def overlay(self, groups: list[dict]) -> None:
        """Shows the hyperparameters in force on groups read from the shards (a change not yet sent included)."""
        for group, current in zip(groups, self._current()):
            group.update({name: tuple(value) if isinstance(value, list) else value for name, value in current.items()})


def clip_coefficient(norms: list[float], max_norm: float, norm_type: float,
                     error_if_nonfinite: bool) -> tuple[torch.Tensor, float]:
    """(the total norm of the stages' gradient norms, the factor clip_grad_norm_ scales every gradient by), computed
    in float32 as torch.nn.utils.clip_grad_norm_ computes them."""
    total = torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32), norm_type) if norms else torch.tensor(0.)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise FailedPrecondition(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot "
                                 "be clipped (error_if_nonfinite=False clips anyway)")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return total, coefficient.item()
