"""Optimizers a deploy may name: an allow-list of torch.optim classes with JSON keyword arguments."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from shardtrain.errors import FailedPrecondition, InvalidArgument

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


# Tensors of a parameter's size each optimizer keeps per parameter (momentum, moments, ...), for memory estimates.
STATE_TENSORS = {"SGD": 1, "Adam": 2, "AdamW": 2, "Adagrad": 1, "Adadelta": 2, "Adamax": 2, "RMSprop": 2, "NAdam": 2,
                 "RAdam": 2, "Rprop": 2, "ASGD": 2}

Groups = Sequence[tuple[Sequence[str], str]]  # param groups: (parameter keys, options as a JSON object), in order


def build(name: str, kwargs_json: str, parameters: Iterable[torch.nn.Parameter] | dict[str, torch.nn.Parameter],
          groups: Groups = ()) -> torch.optim.Optimizer:
    """Constructs the named optimizer over `parameters` (by state-dict key when there are `groups`: each group takes
    the ones it names that are here, so group i is the same group on every stage); InvalidArgument for bad names or
    arguments."""
    if name not in ALLOWED:
        raise InvalidArgument(f"optimizer {name!r} is not allowed; choose one of {ALLOWED}")
    kwargs = json_options(kwargs_json, "optimizer arguments")
    if groups:
        named = dict(parameters)
        chosen = [{**json_options(options, f"param group {index}'s options"),
                   "params": [named[key] for key in keys if key in named]}
                  for index, (keys, options) in enumerate(groups)]
    else:
        chosen = list(parameters.values() if isinstance(parameters, dict) else parameters)
    try:
        return getattr(torch.optim, name)(chosen, **kwargs)
    except Exception as error:  # optimizers check their arguments with many exception types
        raise InvalidArgument(f"cannot build {name} with {kwargs}: {type(error).__name__}: {error}") from None


def json_options(text: str, what: str) -> dict:
    """A JSON object of hyperparameters (`what` names them in errors), lists turned into the tuples torch.optim
    takes (betas)."""
    try:
        value = json.loads(text or "{}")
    except ValueError as error:
        raise InvalidArgument(f"{what} are not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object, got {text!r}")
    return {key: tuple(item) if isinstance(item, list) else item for key, item in value.items()}


def set_hyperparameters(optimizer: torch.optim.Optimizer, hyperparameters_json: str) -> None:
    """Sets each param group's hyperparameters (lr, betas, ...) to the values a client's schedule left in its own
    groups: a JSON list with one object per group. InvalidArgument, changing nothing, if it does not fit."""
    try:
        values = json.loads(hyperparameters_json)
    except ValueError as error:
        raise InvalidArgument(f"hyperparameters are not valid JSON: {error}") from None
    groups = optimizer.param_groups
    if not isinstance(values, list) or len(values) != len(groups) or not all(isinstance(v, dict) for v in values):
        raise InvalidArgument(f"hyperparameters must be a JSON list of {len(groups)} objects, one per param group")
    for index, (update, group) in enumerate(zip(values, groups)):
        for name, value in update.items():
            if name == "params" or not _json_plain(value):
                raise InvalidArgument(f"param group {index}: hyperparameter {name!r} = {value!r} cannot be set; "
                                      "numbers, strings, booleans, null and lists of them can")
            if name in group and not _same_kind(value, group[name]):
                raise InvalidArgument(f"param group {index}: hyperparameter {name!r} is {value!r}, where "
                                      f"{type(optimizer).__name__} has {group[name]!r}")
    for update, group in zip(values, groups):
        group.update({name: tuple(value) if isinstance(value, list) else value for name, value in update.items()})


# --- optimizer state by parameter name ------------------------------------------------------------------
# torch keys an optimizer's state by position in that optimizer's parameter list; shards and the SDK each
# hold different lists, so state travels keyed by the parameters' state-dict keys instead: tensors named
# "<key>/<name>", everything else (hyperparameters, plain values) as JSON, never pickle.
_STATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_VALUE = (bool, int, float, type(None))  # a state entry that is not a tensor
_PLAIN = (*_VALUE, str)                  # a hyperparameter, or an item of a list-valued one


def _settings(group: dict) -> dict:
    """A param group's hyperparameters: everything but its "params"."""
    return {name: value for name, value in group.items() if name != "params"}


@dataclass
class KeyedState:
    """An optimizer's state keyed by parameter name: param groups (hyperparameters, "params" as keys), the state's
    tensors as "<key>/<name>", and its plain values (numbers, booleans, None) the same way."""

    groups: list[dict]
    tensors: dict[str, torch.Tensor]
    values: dict[str, bool | int | float | None]

    def layout(self) -> str:
        """The JSON that travels beside the tensors."""
        try:
            return json.dumps({"param_groups": self.groups, "values": self.values}, allow_nan=True)
        except (TypeError, ValueError) as error:
            raise FailedPrecondition(f"the optimizer's hyperparameters do not fit in JSON: {error}") from None

    @classmethod
    def parse(cls, layout: str, tensors: dict[str, torch.Tensor]) -> KeyedState:
        """The state whose JSON is `layout`; InvalidArgument when it is not shaped as layout() writes it."""
        try:
            tree = json.loads(layout)
        except ValueError as error:
            raise InvalidArgument(f"optimizer state: the layout is not valid JSON: {error}") from None
        groups = tree.get("param_groups") if isinstance(tree, dict) else None
        values = tree.get("values", {}) if isinstance(tree, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or not isinstance(values, dict):
            raise InvalidArgument('optimizer state: the layout must be {"param_groups": [{...}], "values": {...}}')
        for group in groups:
            params = group.get("params")
            if not isinstance(params, list) or not all(isinstance(key, str) for key in params):
                raise InvalidArgument("optimizer state: each param group needs \"params\", a list of parameter keys")
            for name, value in _settings(group).items():
                if not _json_plain(value):
                    raise InvalidArgument(f"optimizer state: hyperparameter {name!r} is {value!r}; numbers, strings, "
                                          "booleans, null and lists of them are allowed")
        for name, value in values.items():
            if not isinstance(value, _VALUE):
                raise InvalidArgument(f"optimizer state: value {name!r} is {value!r}, not a number, boolean or null")
        return cls(groups, dict(tensors), values)


def _json_plain(value) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, list) and all(isinstance(v, _PLAIN) for v in value))


def keyed(state_dict: dict, keys: Sequence[str]) -> KeyedState:
    """A torch optimizer's state_dict, whose positions index `keys`, keyed by parameter name."""
    groups = [{**{name: list(value) if isinstance(value, tuple) else value for name, value in _settings(group).items()},
               "params": [keys[i] for i in group["params"]]} for group in state_dict["param_groups"]]
    tensors, values = {}, {}
    for index, entries in state_dict["state"].items():
        for name, value in entries.items():
            where = f"{keys[index]}/{name}"
            if isinstance(value, torch.Tensor):
                tensors[where] = value.detach()
            elif isinstance(value, _VALUE):
                values[where] = value
            else:
                raise FailedPrecondition(f"optimizer state {where!r} is a {type(value).__name__}, which only "
                                         "tensors, numbers, booleans and None can be")
    return KeyedState(groups, tensors, values)


def indexed(state: KeyedState, keys: Sequence[str]) -> dict:
    """torch's state_dict of an optimizer over the parameters named `keys`, in that order, from `state`;
    InvalidArgument when it names other parameters, or a state entry outside its groups."""
    position = {key: i for i, key in enumerate(keys)}
    named = [key for group in state.groups for key in group["params"]]
    if sorted(named) != sorted(keys):
        missing, extra = sorted(set(keys) - set(named)), sorted(set(named) - set(keys))
        raise InvalidArgument(f"optimizer state: its param groups must name each of these parameters once; "
                              f"missing {missing[:5]}, unknown or repeated {extra[:5] or _repeated(named)[:5]}")
    groups = [{**{name: tuple(value) if isinstance(value, list) else value for name, value in _settings(group).items()},
               "params": sorted(position[key] for key in group["params"])} for group in state.groups]
    entries: dict[int, dict] = {}
    for where, value in [*state.tensors.items(), *state.values.items()]:
        key, _, name = where.rpartition("/")
        if key not in position or not _STATE_NAME.fullmatch(name):
            raise InvalidArgument(f"optimizer state entry {where!r} is not '<parameter key>/<state name>' for a "
                                  f"parameter here ({list(keys)[:5]}...)")
        entries.setdefault(position[key], {})[name] = value
    return {"state": dict(sorted(entries.items())), "param_groups": groups}


def _repeated(keys: list[str]) -> list[str]:
    seen: set[str] = set()
    return [key for key in keys if key in seen or seen.add(key)]


def check_state(optimizer: torch.optim.Optimizer, state: dict, keys: Sequence[str]) -> None:
    """InvalidArgument unless each parameter's entries in `state` (torch's form, for `optimizer` over the parameters
    named `keys`) are the ones a step of this optimizer makes: the same names, each tensor shaped as a step would
    shape it. Where a dry step on meta tensors cannot tell, a tensor must be a scalar or shaped like its parameter."""
    _check_groups(optimizer, state["param_groups"])
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    expected = _one_step_state(optimizer)
    for index, entries in state["state"].items():
        parameter, key = parameters[index], keys[index]
        if expected is not None and set(entries) != set(expected[index]):
            raise InvalidArgument(f"optimizer state of {key!r} has {sorted(entries)}; {type(optimizer).__name__} "
                                  f"keeps {sorted(expected[index])}")
        for name, value in entries.items():
            if not isinstance(value, torch.Tensor):
                continue
            shapes = [expected[index][name]] if expected is not None else [(), tuple(parameter.shape)]
            if tuple(value.shape) not in shapes:
                raise InvalidArgument(f"optimizer state {key}/{name} has shape {list(value.shape)}; expected "
                                      f"{' or '.join(str(list(s)) for s in shapes)}")


def _check_groups(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """InvalidArgument unless `groups` match the optimizer's in number and sizes, and each hyperparameter the
    optimizer has is of the same kind (a number for a number, a boolean for a boolean; None goes with anything)."""
    sizes, own = [len(g["params"]) for g in groups], [len(g["params"]) for g in optimizer.param_groups]
    if sizes != own:
        raise InvalidArgument(f"optimizer state has param groups of {sizes} parameters; this stage's "
                              f"{type(optimizer).__name__} has {own}")
    for group, current in zip(groups, optimizer.param_groups):
        for name, value in _settings(group).items():
            if name in current and not _same_kind(value, current[name]):
                raise InvalidArgument(f"optimizer state: hyperparameter {name!r} is {value!r}, where "
                                      f"{type(optimizer).__name__} has {current[name]!r}")


def _same_kind(value, current) -> bool:
    if value is None or current is None:
        return True
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(current, bool)
    if isinstance(current, (int, float)):
        return isinstance(value, (int, float))
    if isinstance(current, (tuple, list)):
        return isinstance(value, (tuple, list)) and len(value) == len(current) and all(
            _same_kind(v, c) for v, c in zip(value, current))
    return isinstance(value, type(current))


def _one_step_state(optimizer: torch.optim.Optimizer) -> list[dict] | None:
    """Per parameter, {state name: tensor shape or None} after one step of a copy on meta tensors (no memory, no
    arithmetic); None where that copy cannot step (a fused optimizer, ASGD's .item())."""
    groups, probes = [], []
    for group in optimizer.param_groups:
        metas = [torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in group["params"]]
        for meta in metas:
            meta.grad = torch.empty_like(meta)
        probes += metas
        groups.append({**_settings(group), "params": metas})
    try:
        probe = type(optimizer)(groups)
        probe.step()
    except Exception:  # noqa: BLE001 - a copy that cannot step on meta tensors says nothing about the state
        return None
    return [{name: tuple(value.shape) if isinstance(value, torch.Tensor) else None
             for name, value in probe.state[meta].items()} for meta in probes]


def merged(states: Sequence[KeyedState]) -> KeyedState:
    """One state from the stages' states, in stage order: group i of every stage (with parameters) becomes group i.
    A weight tied across stages is in several; its first stage's entries stand for all (they are equal)."""
    groups: list[dict] = []
    tensors, values = {}, {}
    for state in states:
        for index, group in enumerate(state.groups):
            if index == len(groups):
                groups.append({**_settings(group), "params": []})
            groups[index]["params"] += [key for key in group["params"] if key not in groups[index]["params"]]
        tensors.update(state.tensors)
        values.update(state.values)
    return KeyedState(groups, tensors, values)


def split(state: KeyedState, owners: dict[str, int | list[int]], stages: int) -> list[KeyedState]:
    """Each stage's share of `state`, by the stage (or, for a weight tied across stages, the stages) that hold each
    parameter key (`owners`)."""
    holders = {key: owner if isinstance(owner, list) else [owner] for key, owner in owners.items()}
    shares = [KeyedState([], {}, {}) for _ in range(stages)]
    holding = {stage for group in state.groups for key in group["params"] for stage in holders.get(key, ())}
    for group in state.groups:
        settings = _settings(group)
        for stage, share in enumerate(shares):
            if stage in holding:  # every group, empty ones too: group i is the same group on every stage
                share.groups.append({**settings, "params": [key for key in group["params"]
                                                            if stage in holders.get(key, ())]})
    for entries, field in ((state.tensors, "tensors"), (state.values, "values")):
        for where, value in entries.items():
            stages_holding = holders.get(where.rpartition("/")[0])
            if not stages_holding:
                raise InvalidArgument(f"optimizer state entry {where!r} names no parameter of this model")
            for stage in stages_holding:
                getattr(shares[stage], field)[where] = value
    return shares


def from_torch(state_dict, keys: Sequence[str]) -> KeyedState:
    """keyed() for a state_dict a user hands in: InvalidArgument unless it is torch's form for `keys`."""
    try:
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise TypeError("not a dict of 'state' and 'param_groups'")
        return keyed(state_dict, keys)
    except (KeyError, IndexError, TypeError, AttributeError) as error:
        raise InvalidArgument(f"not the state_dict() of a torch.optim optimizer over this model's {len(keys)} "
                              f"parameters ({type(error).__name__}: {error})") from None
