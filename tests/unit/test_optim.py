"""shardtrain.optim: the optimizer allow-list, encoding a choice for the wire and building it on a shard."""

from __future__ import annotations

import json

import pytest
import torch

from shardtrain.errors import InvalidArgument
from shardtrain.optim import ALLOWED, build, encode


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
