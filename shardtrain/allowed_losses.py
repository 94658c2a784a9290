"""Losses a last stage computes in a planned step (train_step): torch.nn losses from an allow-list, by name and
JSON kwargs."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from shardtrain.errors import InvalidArgument

# Loss classes whose constructor takes only plain JSON values; each with the attributes that hold them.
ALLOWED: dict[str, tuple[str, ...]] = {
    "MSELoss": ("reduction",),
    "L1Loss": ("reduction",),
    "SmoothL1Loss": ("reduction", "beta"),
    "HuberLoss": ("reduction", "delta"),
    "CrossEntropyLoss": ("reduction", "ignore_index", "label_smoothing"),
    "NLLLoss": ("reduction", "ignore_index"),
    "BCELoss": ("reduction",),
    "BCEWithLogitsLoss": ("reduction",),
    "KLDivLoss": ("reduction", "log_target"),
}


def encode(loss) -> tuple[str, str]:
    """(name, kwargs JSON) of an allowed loss given as a name, a class or an instance; InvalidArgument otherwise."""
    if isinstance(loss, str):
        return _checked(loss), "{}"
    if isinstance(loss, type) and issubclass(loss, torch.nn.Module):
        return _checked(loss.__name__), "{}"
    allowed_instance = type(loss).__name__ in ALLOWED and type(loss).__module__.startswith("torch.")
    if isinstance(loss, torch.nn.Module) and allowed_instance:
        if getattr(loss, "weight", None) is not None or getattr(loss, "pos_weight", None) is not None:
            raise InvalidArgument(f"{type(loss).__name__} with class weights cannot be shipped by name; "
                                  "give a loss module of your own instead")
        kwargs = {name: getattr(loss, name) for name in ALLOWED[type(loss).__name__]}
        return type(loss).__name__, json.dumps(kwargs)
    raise InvalidArgument(f"loss {loss!r} is not an allowed torch.nn loss; use one of {sorted(ALLOWED)} "
                          "or a loss module of your own")


def _checked(name: str) -> str:
    if name not in ALLOWED:
        raise InvalidArgument(f"loss {name!r} is not allowed; choose one of {sorted(ALLOWED)}")
    return name


def build(name: str, kwargs_json: str) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], bool]:
    """The loss function and whether it sums over the batch (else it averages)."""
    _checked(name)
    try:
        kwargs = json.loads(kwargs_json or "{}")
    except json.JSONDecodeError as error:
        raise InvalidArgument(f"{name}: keyword arguments are not JSON: {error}") from None
    if not isinstance(kwargs, dict) or set(kwargs) - set(ALLOWED[name]):
        raise InvalidArgument(f"{name} takes keyword arguments {list(ALLOWED[name])}, got {kwargs_json!r}")
    if kwargs.get("reduction", "mean") not in ("mean", "sum"):
        raise InvalidArgument(f"{name}: reduction must be 'mean' or 'sum' for train_step, "
                              f"got {kwargs['reduction']!r}")
    try:
        module = getattr(torch.nn, name)(**kwargs)
    except (TypeError, ValueError) as error:
        raise InvalidArgument(f"{name}({kwargs_json}): {error}") from None
    return module, kwargs.get("reduction", "mean") == "sum"
