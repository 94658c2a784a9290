"""shardtrain.residuals: wiring checks, which residuals cross which stage boundaries, and running a chain."""

from __future__ import annotations

import re

import pytest
import torch

from shardtrain.errors import InvalidArgument
from shardtrain.residuals import OUTPUT, StageResiduals, Wiring, check_wiring, route, run_chain

PLAIN = Wiring()


def saves(*names: str) -> Wiring:
    return Wiring(out_variables=names)


def uses(*names: str) -> Wiring:
    return Wiring(dependencies=names)


# The seed model's wiring: layer 2 saves res_1, layer 6 consumes it.
SEED_WIRING = [PLAIN, PLAIN, saves("res_1"), PLAIN, PLAIN, PLAIN, uses("res_1"), PLAIN, PLAIN, PLAIN]


def test_check_wiring_returns_each_residuals_producer():
    wirings = [saves("a", "b"), uses("a"), Wiring(("b",), ("c",)), uses("a", "c")]
    assert check_wiring(wirings) == {"a": 0, "b": 0, "c": 2}


def test_check_wiring_of_plain_layers_is_empty():
    assert check_wiring([PLAIN, PLAIN]) == {}


def test_dependency_nobody_saved_is_named_with_what_was_saved():
    with pytest.raises(InvalidArgument, match=r"layer 1 depends on 'missing'.*saved so far: \['a'\]"):
        check_wiring([saves("a"), uses("missing")])


def test_dependency_saved_only_later_is_refused():
    with pytest.raises(InvalidArgument, match="layer 0 depends on 'a'"):
        check_wiring([uses("a"), saves("a")])


def test_layer_cannot_depend_on_what_it_saves_itself():
    with pytest.raises(InvalidArgument, match="layer 0 depends on 'a'"):
        check_wiring([Wiring(("a",), ("a",))])


def test_name_saved_twice_names_both_layers():
    with pytest.raises(InvalidArgument, match="layer 2 saves 'a', already saved by layer 0"):
        check_wiring([saves("a"), PLAIN, saves("a")])


@pytest.mark.parametrize("name", ["", "1a", "a b", OUTPUT, "a;b", "a'b", "x()"])
def test_names_that_are_not_plain_identifiers_are_refused(name):
    with pytest.raises(InvalidArgument, match=re.escape(f"layer 0: residual name {name!r} must be a plain identifier")):
        check_wiring([saves(name)])


@pytest.mark.parametrize("name", ["res_1", "_x", "block.3.skip", "a-b"])
def test_plain_names_are_accepted(name):
    assert check_wiring([saves(name)]) == {name: 0}


ROUTES = [
    # wirings, ranges, expected (incoming, outgoing) per stage
    pytest.param([saves("r"), uses("r"), PLAIN], [(0, 2), (2, 3)],
                 [({}, {}), ({}, {})], id="within-one-stage"),
    pytest.param([saves("r"), PLAIN, uses("r")], [(0, 2), (2, 3)],
                 [({}, {"r": [1]}), ({"r": 0}, {})], id="adjacent-stages"),
    pytest.param([saves("r"), PLAIN, uses("r")], [(0, 1), (1, 2), (2, 3)],
                 [({}, {"r": [2]}), ({}, {}), ({"r": 0}, {})], id="skips-a-stage"),
    pytest.param([saves("r"), uses("r"), uses("r")], [(0, 1), (1, 2), (2, 3)],
                 [({}, {"r": [1, 2]}), ({"r": 0}, {}), ({"r": 0}, {})], id="two-consumer-stages"),
    pytest.param([saves("r"), uses("r"), uses("r"), PLAIN], [(0, 1), (1, 4)],
                 [({}, {"r": [1]}), ({"r": 0}, {})], id="two-consumers-in-one-stage-fetch-once"),
    pytest.param([saves("r"), uses("r"), Wiring(("r",), ("s",)), uses("s")], [(0, 1), (1, 2), (2, 3), (3, 4)],
                 [({}, {"r": [1, 2]}), ({"r": 0}, {}), ({"r": 0}, {"s": [3]}), ({"s": 2}, {})],
                 id="consumer-is-also-a-producer"),
    pytest.param(SEED_WIRING, [(0, 3), (3, 5), (5, 10)],
                 [({}, {"res_1": [2]}), ({}, {}), ({"res_1": 0}, {})], id="seed-model"),
    pytest.param(SEED_WIRING, [(0, 2), (2, 7), (7, 10)],
                 [({}, {}), ({}, {}), ({}, {})], id="seed-model-residual-inside-stage-1"),
]


@pytest.mark.parametrize(("wirings", "ranges", "expected"), ROUTES)
def test_route(wirings, ranges, expected):
    assert route(wirings, ranges) == [StageResiduals(incoming, outgoing) for incoming, outgoing in expected]


def test_route_checks_the_wiring_first():
    with pytest.raises(InvalidArgument, match="depends on 'r'"):
        route([uses("r")], [(0, 1)])


# run_chain with tiny modules.

class Save(torch.nn.Module):
    """Doubles x and saves x + 1 and x + 2 as extra outputs."""

    def forward(self, x):
        return x * 2, x + 1, x + 2


class AddAll(torch.nn.Module):
    """Adds every dependency to x."""

    def forward(self, x, *dependencies):
        for dependency in dependencies:
            x = x + dependency
        return x


def test_run_chain_passes_saved_tensors_to_later_layers():
    x = torch.tensor([1.0])
    saved = {}
    out = run_chain([Save(), AddAll(), AddAll()], [saves("a", "b"), uses("b"), uses("a", "b")], x, saved)
    # Save: x=2, a=2, b=3. AddAll(b): 5. AddAll(a, b): 10.
    assert out.tolist() == [10.0]
    assert {k: v.tolist() for k, v in saved.items()} == {"a": [2.0], "b": [3.0]}


def test_run_chain_reads_incoming_residuals_from_saved():
    out = run_chain([AddAll()], [uses("r")], torch.tensor([1.0]), {"r": torch.tensor([4.0])})
    assert out.tolist() == [5.0]


def test_run_chain_passes_dependencies_in_wiring_order():
    class Subtract(torch.nn.Module):
        def forward(self, x, first, second):
            return x + first - second

    saved = {"p": torch.tensor([10.0]), "q": torch.tensor([1.0])}
    assert run_chain([Subtract()], [uses("q", "p")], torch.tensor([0.0]), saved).tolist() == [-9.0]


def test_run_chain_of_no_layers_returns_input():
    x = torch.tensor([3.0])
    assert run_chain([], [], x, {}) is x
