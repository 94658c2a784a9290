"""A model built on the meta device, initialised one part at a time: the client never holds the whole model.

`with torch.device("meta"): net = Net()` allocates nothing and draws no random numbers. Deploying it captures
and partitions from shapes alone; then each module's own tensors are made on the CPU, initialised by its
`reset_parameters` (or `reset_running_stats`) in the order the modules' constructors finished (children before
their parent), drawing from torch's random stream as building the model on the CPU would have, pushed to their
stages as soon as every tensor of a layer is ready, and dropped once no layer still waits for them. So
`torch.manual_seed(s)` before building on meta deploys the weights `torch.manual_seed(s); Net()` would have, for
models whose modules initialise themselves in reset_parameters (a tied weight takes its first owner's values).

A library that initialises its models again after their constructors ran (a Hugging Face PreTrainedModel's
_init_weights, from post_init) is followed too: the build's draws are replayed first on throwaway tensors, keeping
only the random state before each, then each module is made from those states (its constructor's values, then the
library's over them), so the weights equal `torch.manual_seed(s); Model(config)` while only one module's tensors
are made at a time.
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
        if own and not (_initialiser(sub) or _library_initialiser(module, name, sub)) and \
                any(t.is_meta for _, t in own):
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
    states = _random_states(work)
    for name, sub in [(name, sub) for name, sub in _constructed_order(work) if _own_meta(sub)]:
        originals = {key: id(t) for key, t in (*sub._parameters.items(), *sub._buffers.items()) if t is not None}
        sub.to_empty(device="cpu", recurse=False)
        _initialise(work, name, sub, states)  # a tied tensor's later owners draw too, as they did
        for key, identity in originals.items():
            made.setdefault(identity, getattr(sub, key).detach())
            for full in names.get(identity, ()):
                ready[full] = made[identity]
        _push_complete(pending, ready, push)
    if states is not None:
        torch.set_rng_state(states[2])  # where building the model on the CPU would have left it
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
        work = _made_alone(sub)
        initialiser = _initialiser(work) or _library_initialiser(module, name, work)
        if initialiser is None:
            raise InvalidArgument(f"{name or 'the model'} ({type(sub).__name__}) holds non-persistent buffers "
                                  f"{list(sub._buffers)[:4]} on the meta device, which no checkpoint holds, and has no "
                                  "reset_parameters() to compute them; give it one, or build that module off meta")
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


def _made_alone(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `module` with its own tensors new and uninitialised on the CPU (the children shared):
    to_empty would change the original's Parameter objects in place."""
    alone = copy.copy(module)
    alone._parameters = {key: None if p is None else torch.nn.Parameter(torch.empty_like(p, device="cpu"),
                                                                         p.requires_grad)
                         for key, p in module._parameters.items()}
    alone._buffers = {key: None if b is None else torch.empty_like(b, device="cpu")
                      for key, b in module._buffers.items()}
    return alone


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


def _constructed_order(module: torch.nn.Module, prefix: str = ""):
    """(name, module) in the order their constructors finished: children (in order) before their parent, which
    resets its own tensors at the end of its __init__, as nn.MultiheadAttention does after making its out_proj.
    A Hugging Face model's initialize_weights goes in the same order."""
    for name, child in module.named_children():
        yield from _constructed_order(child, f"{prefix}{name}.")
    yield prefix[:-1], module


def _own_meta(module: torch.nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in (*module._parameters.values(), *module._buffers.values()))


def _random_states(model: torch.nn.Module) -> tuple[dict, dict, torch.Tensor] | None:
    """For a model a library initialises after its constructors: torch's random state before each module's
    constructor drew and before the library initialised it, by name, and the state after the whole build; found
    by drawing as building on the CPU would, on throwaway tensors. A library model (a Hugging Face
    PreTrainedModel) initialises, at the end of its own constructor, every module below it not yet initialised,
    children first: an inner model's modules before the outer model's own later children are even made. None
    (and nothing drawn) for a model no library initialises."""
    modules = list(_constructed_order(model))
    if not any(callable(getattr(sub, "_init_weights", None)) for _, sub in modules):
        return None
    constructors, library = {}, {}
    for name, sub in modules:
        if _own_meta(sub) and _initialiser(sub) is not None:
            constructors[name] = torch.get_rng_state()
            with torch.no_grad():
                _initialiser(_made_alone(sub))()
        if callable(getattr(sub, "_init_weights", None)):
            for inner, module in _constructed_order(sub, f"{name}." if name else ""):
                if inner not in library and _own_meta(module):
                    library[inner] = torch.get_rng_state()
                    with torch.no_grad():
                        _library_initialiser(model, inner, _made_alone(module))()
    return constructors, library, torch.get_rng_state()


def _initialise(model: torch.nn.Module, name: str, module: torch.nn.Module, states) -> None:
    """Initialises `module`'s own (freshly made) tensors: by its initialiser, drawing from torch's stream; or, for
    a library's model, by its constructor's initialiser and then the library's, each from the random state it
    drew from when the model was built."""
    with torch.no_grad():
        if states is None:
            _initialiser(module)()
            return
        constructors, library, _ = states
        if name in constructors:
            torch.set_rng_state(constructors[name])
            _initialiser(module)()
        if name in library:
            torch.set_rng_state(library[name])
            _library_initialiser(model, name, module)()


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
