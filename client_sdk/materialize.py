"""A model built on the meta device, initialised one part at a time: the client never holds the whole model.

`with torch.device("meta"): net = Net()` allocates nothing and draws no random numbers. Deploying it captures
and partitions from shapes alone; then each module's own tensors are made on the CPU, initialised by its
`reset_parameters` (or `reset_running_stats`) in the order the modules' constructors finished (children before
their parent), drawing from torch's random stream as building the model on the CPU would have, pushed to their
stages as soon as every tensor of a layer is ready, and dropped once no layer still waits for them. So
`torch.manual_seed(s)` before building on meta deploys the weights `torch.manual_seed(s); Net()` would have, for
models whose modules initialise themselves in reset_parameters (a tied weight takes its first owner's values).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch

from shardtrain.errors import InvalidArgument


def is_empty(module: torch.nn.Module) -> bool:
    """True for a model whose tensors are on the meta device (built under torch.device("meta"))."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def check_initialisable(module: torch.nn.Module) -> None:
    """InvalidArgument naming a module whose tensors are on meta and that has no way to initialise them."""
    for name, sub in module.named_modules():
        own = [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
        if own and not _initialiser(sub) and any(t.is_meta for _, t in own):
            raise InvalidArgument(f"{name or 'the model'} ({type(sub).__name__}) holds {[k for k, _ in own][:4]} on "
                                  "the meta device and has no reset_parameters() to initialise them; give it one, or "
                                  "deploy a model built with its weights")


def initialise_in_parts(module: torch.nn.Module, layer_keys: Sequence[set[str]],
                        push: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Initialises a copy of `module` module by module (leaving `module` on meta) and calls `push` with each
    layer's state as soon as all of it is ready; tensors are freed once every layer holding them was pushed."""
    check_initialisable(module)
    work = copy.deepcopy(module)
    names = _keys_by_tensor(work)
    ready: dict[str, torch.Tensor] = {}
    pending = [set(keys) for keys in layer_keys]
    made: dict[int, torch.Tensor] = {}  # a tied tensor keeps the value its first owner gave it
    for sub in _constructed_order(work):
        own = [(key, t) for key, t in (*sub._parameters.items(), *sub._buffers.items()) if t is not None]
        if not any(t.is_meta for _, t in own):
            continue
        originals = {key: id(t) for key, t in own}
        sub.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            _initialiser(sub)()  # a tied tensor's later owners draw too, as their constructors did
        for key, identity in originals.items():
            made.setdefault(identity, getattr(sub, key).detach())
            for full in names.get(identity, ()):
                ready[full] = made[identity]
        _push_complete(pending, ready, push)
    if any(pending):
        missing = sorted(set().union(*pending))[:5]
        raise InvalidArgument(f"the stages hold {missing}, which no module of the model initialised")


def initialise_buffers(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`values` (non-persistent buffers and constants of the forward, which a checkpoint leaves out) with those on
    the meta device computed: each module owning one is made and initialised alone, by its own initialiser or its
    library's (a Hugging Face model's _init_weights computes a rotary embedding's inv_freq from the config)."""
    wanted = {key for key, value in values.items() if value.is_meta}
    made = {key: value if not value.is_meta else torch.empty(value.shape, dtype=value.dtype)
            for key, value in values.items() if not value.is_meta or not value.numel()}  # nothing to compute
    owners = {name: sub for name, sub in module.named_modules()
              if any((f"{name}.{b}" if name else b) in wanted for b in sub._buffers)}
    for name, sub in owners.items():
        work = copy.copy(sub)  # its own tensors only: to_empty(recurse=False) replaces them in the copy's dicts
        work._parameters, work._buffers = dict(sub._parameters), dict(sub._buffers)
        initialiser = _initialiser(work) or _library_initialiser(module, name, work)
        if initialiser is None:
            raise InvalidArgument(f"{name or 'the model'} ({type(sub).__name__}) holds non-persistent buffers "
                                  f"{list(sub._buffers)[:4]} on the meta device, which no checkpoint holds, and has no "
                                  "reset_parameters() to compute them; give it one, or build that module off meta")
        work.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            initialiser()
        for buffer_name, buffer in work.named_buffers(recurse=False):
            key = f"{name}.{buffer_name}" if name else buffer_name
            if key in wanted:
                made[key] = buffer.detach()
    unmade = sorted(set(values) - set(made))
    if unmade:
        raise InvalidArgument(f"the stages read {unmade[:4]}, tensors the model's forward makes from values on the "
                              "meta device; build the model off meta, or make them buffers of a module")
    return made


def _library_initialiser(model: torch.nn.Module, name: str, module: torch.nn.Module) -> Callable[[], None] | None:
    """The initialiser a library gives a module through the nearest ancestor that has one (a Hugging Face
    PreTrainedModel's _init_weights(module))."""
    parts = name.split(".") if name else []
    for end in range(len(parts), -1, -1):
        owner = model.get_submodule(".".join(parts[:end]))
        if callable(getattr(owner, "_init_weights", None)):
            return lambda: owner._init_weights(module)
    return None


def _push_complete(pending: list[set[str]], ready: dict[str, torch.Tensor], push) -> None:
    """Pushes every layer whose tensors are all ready, then forgets tensors no layer still waits for."""
    for keys in pending:
        if keys and keys <= ready.keys():
            push({key: ready[key] for key in keys})
            keys.clear()
    wanted = set().union(*pending) if pending else set()
    for key in [key for key in ready if key not in wanted]:
        del ready[key]


def _constructed_order(module: torch.nn.Module):
    """Modules in the order their constructors finished: children (in order) before their parent, which resets
    its own tensors at the end of its __init__, as nn.MultiheadAttention does after making its out_proj."""
    for child in module.children():
        yield from _constructed_order(child)
    yield module


def _keys_by_tensor(module: torch.nn.Module) -> dict[int, list[str]]:
    """Every state key of each tensor (several for tied weights), by the tensor's identity."""
    keys: dict[int, list[str]] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for key, tensor in named:
        keys.setdefault(id(tensor), []).append(key)
    return keys


def _initialiser(module: torch.nn.Module) -> Callable[[], None] | None:
    for name in ("reset_parameters", "_reset_parameters", "reset_running_stats"):
        if callable(getattr(module, name, None)):
            return getattr(module, name)
    return None
