"""Python state a capture fixes: the float and bool attributes of the model's own classes that its forward reads,
and draws from Python's `random`. A captured graph holds their values at deploy; later changes never reach the
shards, so deploy names them in a warning."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator

import torch

_DRAWS = ("random", "uniform", "randint", "randrange", "choice", "gauss", "normalvariate", "shuffle", "sample")


def frozen_reads(module: torch.nn.Module, run: Callable[[], object]) -> list[str]:
    """What `run()` (a forward of `module`) reads that a capture would fix, as "Class.attribute = value" and
    "random.name()" lines, each once, in the order first read."""
    seen: dict[str, None] = {}
    try:
        with _attribute_reads(module, seen), _random_draws(seen):
            run()
    except torch._dynamo.exc.TorchDynamoException:  # torch.cond compiles its branches even in eager mode, and
        seen.clear()                                 # cannot trace the watching classes: watch the draws alone
        with _random_draws(seen):
            run()
    return list(seen)


@contextlib.contextmanager
def _attribute_reads(module: torch.nn.Module, seen: dict[str, None]) -> Iterator[None]:
    """Swaps each submodule of a class of the user's own for a subclass that notes plain float and bool
    attributes as they are read (torch's own layers hold configuration, not state)."""
    swapped = []
    for submodule in module.modules():
        original = type(submodule)
        if original.__module__.split(".")[0] == "torch":
            continue
        try:
            submodule.__class__ = type(original.__name__, (original,), {"__getattribute__": _noting(seen),
                                                                        "__module__": original.__module__})
        except TypeError:  # a class Python cannot swap (another layout): not watched
            continue
        swapped.append((submodule, original))
    try:
        yield
    finally:
        for submodule, original in swapped:
            submodule.__class__ = original


def _noting(seen: dict[str, None]):
    def __getattribute__(self, name: str):
        value = object.__getattribute__(self, name)
        if type(value) in (float, bool) and name != "training" and not name.startswith("_") \
                and name in object.__getattribute__(self, "__dict__"):
            seen.setdefault(f"{type(self).__name__}.{name} = {value!r}", None)
        return value
    return __getattribute__


@contextlib.contextmanager
def _random_draws(seen: dict[str, None]) -> Iterator[None]:
    originals = {name: getattr(random, name) for name in _DRAWS}

    def noting(name: str, draw: Callable) -> Callable:
        def drawn(*args, **kwargs):
            seen.setdefault(f"random.{name}()", None)
            return draw(*args, **kwargs)
        return drawn
    for name, draw in originals.items():
        setattr(random, name, noting(name, draw))
    try:
        yield
    finally:
        for name, draw in originals.items():
            setattr(random, name, draw)
