"""Optimizers a deploy may name: an allow-list of torch.optim classes with JSON keyword arguments."""

from __future__ import annotations

import json
from collections.abc import Iterable

import torch

from shardtrain.errors import InvalidArgument

ALLOWED = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "NAdam", "RAdam", "Rprop", "ASGD")


def encode(optimizer: type | str, kwargs: dict | None = None) -> tuple[str, str]:
    """(name, kwargs as JSON) for an optimizer class or name from the allow-list."""
    name = optimizer if isinstance(optimizer, str) else optimizer.__name__
    if name not in ALLOWED or (not isinstance(optimizer, str) and getattr(torch.optim, name) is not optimizer):
        raise InvalidArgument(f"optimizer {optimizer!r} is not allowed; choose one of torch.optim.{ALLOWED}")
    try:
        return name, json.dumps(kwargs or {})
    except (TypeError, ValueError) as error:
        raise InvalidArgument(f"optimizer arguments must be JSON numbers, strings, lists: {error}") from None


def build(name: str, kwargs_json: str, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Constructs the named optimizer over `parameters`; InvalidArgument for bad names or arguments."""
    if name not in ALLOWED:
        raise InvalidArgument(f"optimizer {name!r} is not allowed; choose one of {ALLOWED}")
    try:
        kwargs = json.loads(kwargs_json or "{}")
    except ValueError as error:
        raise InvalidArgument(f"optimizer arguments are not valid JSON: {error}") from None
    if not isinstance(kwargs, dict):
        raise InvalidArgument(f"optimizer arguments must be a JSON object, got {kwargs_json!r}")
    kwargs = {key: tuple(value) if isinstance(value, list) else value for key, value in kwargs.items()}
    try:
        return getattr(torch.optim, name)(list(parameters), **kwargs)
    except Exception as error:  # optimizers check their arguments with many exception types
        raise InvalidArgument(f"cannot build {name} with {kwargs}: {type(error).__name__}: {error}") from None
