"""shardtrain.optim: the optimizer allow-list, encoding a choice for the wire and building it on a shard."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from shardtrain.errors import InvalidArgument
from shardtrain.optim import (ALLOWED, KeyedState, build, check_state, encode, from_torch, indexed, keyed, merged,
                              set_hyperparameters, split)


def parameters():
    return [torch.nn.Parameter(torch.zeros(3))]


class SGD(torch.optim.SGD):
    """A user subclass that borrows an allowed name."""


class MySGD(torch.optim.SGD):
    """A user subclass with a name of its own."""


def test_encode_a_class():
    assert encode(torch.optim.Adam, {"lr": 0.01}) == ("Adam", '{"lr": 0.01}')


def test_encode_a_name():
    assert encode("SGD", {"lr": 0.1, "momentum": 0.9}) == ("SGD", '{"lr": 0.1, "momentum": 0.9}')


def test_encode_without_kwargs_is_an_empty_object():
    assert encode(torch.optim.AdamW) == ("AdamW", "{}")


def test_encode_tuples_become_lists():
    name, kwargs = encode(torch.optim.Adam, {"betas": (0.8, 0.9)})
    assert json.loads(kwargs) == {"betas": [0.8, 0.9]}


@pytest.mark.parametrize("optimizer", [SGD, MySGD, torch.optim.LBFGS, "LBFGS", "sgd", "Optimizer", dict])
def test_encode_refuses_what_is_not_on_the_allow_list(optimizer):
    with pytest.raises(InvalidArgument, match=rf"optimizer {optimizer!r} is not allowed.*SGD"):
        encode(optimizer)


@pytest.mark.parametrize("value", [torch.tensor(0.1), {0.1}, object()])
def test_encode_refuses_kwargs_json_cannot_carry(value):
    with pytest.raises(InvalidArgument, match="optimizer arguments must be JSON"):
        encode(torch.optim.SGD, {"lr": value})


@pytest.mark.parametrize("name", ALLOWED)
def test_every_allowed_name_is_a_torch_optimizer_that_builds_with_defaults(name):
    kwargs = '{"lr": 0.01}' if name == "SGD" else "{}"
    assert type(build(name, kwargs, parameters())) is getattr(torch.optim, name)


def test_build_applies_the_kwargs():
    optimizer = build("SGD", '{"lr": 0.5, "momentum": 0.9}', parameters())
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert optimizer.param_groups[0]["momentum"] == 0.9


def test_build_turns_json_lists_into_tuples():
    optimizer = build("Adam", '{"betas": [0.8, 0.99]}', parameters())
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.99)
    assert isinstance(optimizer.param_groups[0]["betas"], tuple)


def test_build_over_the_given_parameters():
    weights = parameters()
    assert build("SGD", '{"lr": 1}', weights).param_groups[0]["params"][0] is weights[0]


def test_build_with_empty_kwargs_json_uses_defaults():
    assert build("Adam", "", parameters()).param_groups[0]["lr"] == 0.001


def test_encode_then_build_round_trips():
    optimizer = build(*encode(torch.optim.RMSprop, {"lr": 0.02, "alpha": 0.9}), parameters())
    assert type(optimizer) is torch.optim.RMSprop
    assert (optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["alpha"]) == (0.02, 0.9)


@pytest.mark.parametrize(("kwargs", "why"), [
    ('{"lr": 0.1, "bogus": 1}', "bogus"),
    ('{"lr": -1}', "Invalid learning rate"),
    ('{"lr": "fast"}', "lr"),
    ('{"nesterov": true}', "Nesterov momentum requires"),
])
def test_build_with_bad_kwargs_names_the_optimizer_and_the_problem(kwargs, why):
    with pytest.raises(InvalidArgument, match=rf"cannot build SGD with .*{why}"):
        build("SGD", kwargs, parameters())


def test_build_with_a_bad_tuple_names_the_optimizer_and_the_value():
    with pytest.raises(InvalidArgument, match=r"cannot build Adam with \{'betas': \(1.5, 0.9\)\}.*beta"):
        build("Adam", '{"betas": [1.5, 0.9]}', parameters())


def test_build_with_too_short_betas_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="cannot build Adam"):
        build("Adam", '{"betas": [0.9]}', parameters())


@pytest.mark.parametrize("name", ["LBFGS", "Optimizer", "sgd", "", "__import__"])
def test_build_refuses_an_unknown_name(name):
    with pytest.raises(InvalidArgument, match=f"optimizer {name!r} is not allowed"):
        build(name, "{}", parameters())


@pytest.mark.parametrize("kwargs", ["[0.1]", "0.1", '"lr"', "null"])
def test_build_refuses_kwargs_that_are_not_a_json_object(kwargs):
    with pytest.raises(InvalidArgument, match="must be a JSON object"):
        build("SGD", kwargs, parameters())


def test_build_refuses_invalid_json():
    with pytest.raises(InvalidArgument, match="optimizer arguments are not valid JSON"):
        build("SGD", "{lr: 0.1}", parameters())


# --- optimizer state by parameter name ---------------------------------------------------------------------

def stepped(optimizer_class=torch.optim.Adam, steps: int = 2, **kwargs):
    """(a model, an optimizer over its parameters that has stepped, the parameters' keys)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = optimizer_class(model.parameters(), lr=0.01, **kwargs)
    for _ in range(steps):
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
    return model, optimizer, [name for name, _ in model.named_parameters()]


def same_state(a: dict, b: dict) -> bool:
    return a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys() and all(
        a["state"][i].keys() == b["state"][i].keys() and all(
            torch.equal(v, b["state"][i][n]) if isinstance(v, torch.Tensor) else v == b["state"][i][n]
            for n, v in a["state"][i].items()) for i in a["state"])


@pytest.mark.parametrize("name", ALLOWED)
def test_every_allowed_optimizers_state_survives_keying_splitting_and_the_json_it_travels_in(name):
    _, optimizer, keys = stepped(getattr(torch.optim, name))
    original = optimizer.state_dict()
    state = keyed(original, keys)
    assert set(state.tensors) >= {f"0.weight/{n}" for n, v in original["state"].get(0, {}).items()
                                if torch.is_tensor(v)}
    owners = {"0.weight": 0, "0.bias": 0, "1.weight": 1, "1.bias": 1}
    shares = [KeyedState.parse(share.layout(), share.tensors) for share in split(state, owners, 2)]
    assert [share.groups[0]["params"] for share in shares] == [["0.weight", "0.bias"], ["1.weight", "1.bias"]]
    assert same_state(indexed(merged(shares), keys), original)
    check_state(optimizer, indexed(merged(shares), keys), keys)


def test_indexed_refuses_a_state_for_other_parameters():
    _, optimizer, keys = stepped()
    state = keyed(optimizer.state_dict(), keys)
    with pytest.raises(InvalidArgument, match=r"missing \[\], unknown or repeated \['1.bias'\]"):
        indexed(state, keys[:3])  # names 1.bias, which is not a parameter here
    state.tensors["9.weight/exp_avg"] = torch.zeros(1)
    with pytest.raises(InvalidArgument, match=r"'9.weight/exp_avg' is not '<parameter key>/<state name>'"):
        indexed(state, keys)


def test_check_state_refuses_other_names_and_shapes_and_falls_back_where_a_dry_step_cannot_tell():
    _, optimizer, keys = stepped()
    state = copy.deepcopy(optimizer.state_dict())  # state_dict() shares the optimizer's own per-parameter dicts
    state["state"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises(InvalidArgument, match=r"optimizer state 0.weight/exp_avg has shape \[3\]; expected \[4, 3\]"):
        check_state(optimizer, state, keys)
    state = copy.deepcopy(optimizer.state_dict())
    state["state"][1]["momentum_buffer"] = state["state"][1].pop("exp_avg")
    with pytest.raises(InvalidArgument, match=r"of '0.bias' has \['exp_avg_sq', 'momentum_buffer', 'step'\]; "
                                              r"Adam keeps \['exp_avg', 'exp_avg_sq', 'step'\]"):
        check_state(optimizer, state, keys)
    _, fused, keys = stepped(fused=True)  # fused Adam cannot step on meta tensors: shapes only
    state = copy.deepcopy(fused.state_dict())
    check_state(fused, state, keys)
    state["state"][0]["exp_avg_sq"] = torch.zeros(4)
    with pytest.raises(InvalidArgument, match=r"expected \[\] or \[4, 3\]"):
        check_state(fused, state, keys)


def test_check_state_refuses_other_param_groups_and_hyperparameters_of_another_kind():
    _, optimizer, keys = stepped()
    state = copy.deepcopy(optimizer.state_dict())
    state["param_groups"] = [{**state["param_groups"][0], "params": [0, 1]},
                             {**state["param_groups"][0], "params": [2, 3]}]
    with pytest.raises(InvalidArgument, match=r"param groups of \[2, 2\] parameters; this stage's Adam has \[4\]"):
        check_state(optimizer, state, keys)
    for name, value in (("lr", "fast"), ("betas", (0.9,)), ("amsgrad", 1)):
        state = copy.deepcopy(optimizer.state_dict())
        state["param_groups"][0][name] = value
        with pytest.raises(InvalidArgument, match=f"hyperparameter '{name}' is"):
            check_state(optimizer, state, keys)
    state = copy.deepcopy(optimizer.state_dict())
    state["param_groups"][0].update(lr=1, foreach=True)  # an int for a float, a bool for None: the same kinds
    check_state(optimizer, state, keys)


@pytest.mark.parametrize("layout, match", [
    ("{", "not valid JSON"),
    ('{"param_groups": {}}', "must be"),
    ('{"param_groups": [{"lr": 1}]}', "needs \"params\""),
    ('{"param_groups": [{"params": ["a"], "lr": {"x": 1}}]}', "hyperparameter 'lr'"),
    ('{"param_groups": [], "values": {"a/step": "one"}}', "value 'a/step' is 'one'"),
])
def test_a_layout_that_is_not_what_layout_writes_is_refused(layout, match):
    with pytest.raises(InvalidArgument, match=match):
        KeyedState.parse(layout, {})


def test_from_torch_refuses_what_is_not_an_optimizers_state_dict():
    _, optimizer, keys = stepped()
    with pytest.raises(InvalidArgument, match=r"not the state_dict\(\) of a torch.optim optimizer over this model's 4"):
        from_torch({"state": {}, "param_groups": [{"params": [7]}]}, keys)
    with pytest.raises(InvalidArgument, match="not the state_dict"):
        from_torch(optimizer, keys)


def grouped(steps: int = 2):
    """(a model, AdamW over it in two groups that has stepped, the keys in the optimizer's order)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    weights, biases = [model[0].weight, model[1].weight], [model[0].bias, model[1].bias]
    optimizer = torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=0.01)
    for _ in range(steps):
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
    return model, optimizer, ["0.weight", "1.weight", "0.bias", "1.bias"]


def test_groups_split_by_stage_keep_their_index_and_merge_back_into_the_same_groups():
    _, optimizer, keys = grouped()
    original = optimizer.state_dict()
    owners = {"0.weight": 0, "0.bias": 0, "1.weight": 1, "1.bias": 1}
    shares = split(keyed(original, keys), owners, 2)
    assert [[g["params"] for g in share.groups] for share in shares] == [[["0.weight"], ["0.bias"]],
                                                                        [["1.weight"], ["1.bias"]]]
    assert same_state(indexed(merged(shares), keys), original)


def test_build_with_groups_takes_the_parameters_it_holds_and_keeps_empty_groups_in_place():
    weight, bias = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    groups = [(["0.weight", "1.weight"], '{"lr": 0.5}'), (["9.bias"], "{}"), (["0.bias"], '{"momentum": 0.9}')]
    optimizer = build("SGD", '{"lr": 0.1}', {"0.weight": weight, "0.bias": bias}, groups)
    assert [g["params"] for g in optimizer.param_groups] == [[weight], [], [bias]]
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.1, 0.1]
    assert optimizer.param_groups[2]["momentum"] == 0.9


def test_set_hyperparameters_sets_each_group_and_refuses_what_does_not_fit_changing_nothing():
    _, optimizer, _ = grouped(steps=0)
    set_hyperparameters(optimizer, json.dumps([{"lr": 0.5, "betas": [0.8, 0.9]}, {"lr": 0.25, "initial_lr": 0.01}]))
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.25]
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9) and optimizer.param_groups[1]["initial_lr"] == 0.01
    for bad, why in (([{"lr": 1}], "a JSON list of 2 objects"), ([{"lr": "fast"}, {}], "'lr' is 'fast'"),
                     ([{"params": []}, {}], "'params'"), ([{"lr": {"a": 1}}, {}], "cannot be set")):
        with pytest.raises(InvalidArgument, match=why):
            set_hyperparameters(optimizer, json.dumps(bad))
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.25]


def test_a_weight_tied_across_stages_goes_to_every_stage_holding_it_and_merges_back_once():
    _, optimizer, keys = stepped()
    original = optimizer.state_dict()
    holders = {"0.weight": [0, 1], "0.bias": [0], "1.weight": [1], "1.bias": [1]}
    shares = split(keyed(original, keys), holders, 2)
    assert [share.groups[0]["params"] for share in shares] == [["0.weight", "0.bias"], ["0.weight", "1.weight",
                                                                                      "1.bias"]]
    assert set(shares[1].tensors) >= {"0.weight/exp_avg", "1.weight/exp_avg"}
    assert same_state(indexed(merged(shares), keys), original)
