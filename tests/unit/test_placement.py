"""coordinator.placement: stage i on shard i, with neighbour and residual producer addresses resolved."""

from __future__ import annotations

from coordinator.placement import StagePlacement, place, tied_stages
from coordinator.registry import ShardRecord
from shardtrain.residuals import StageResiduals

SHARDS = [ShardRecord(f"shard-{i}", f"host{i}:700{i}", "cpu") for i in range(4)]


def test_single_stage_has_no_neighbours():
    assert place([(0, 5)], [StageResiduals()], SHARDS[:1]) == [
        StagePlacement(0, SHARDS[0], 0, 5, previous_address="", next_address="", incoming={}, outgoing={}),
    ]


def test_three_stages_of_the_seed_model_with_a_residual_skipping_a_stage():
    routes = [StageResiduals(outgoing={"res_1": [2]}), StageResiduals(), StageResiduals(incoming={"res_1": 0})]
    assert place([(0, 3), (3, 5), (5, 10)], routes, SHARDS[:3]) == [
        StagePlacement(0, SHARDS[0], 0, 3, "", "host1:7001", {}, {"res_1": [2]}, {"res_1": ["host2:7002"]}),
        StagePlacement(1, SHARDS[1], 3, 5, "host0:7000", "host2:7002", {}, {}),
        StagePlacement(2, SHARDS[2], 5, 10, "host1:7001", "", {"res_1": (0, "host0:7000")}, {}),
    ]


def test_residuals_from_two_producers_resolve_to_each_producers_address():
    routes = [StageResiduals(outgoing={"a": [1, 3]}), StageResiduals(incoming={"a": 0}, outgoing={"b": [3]}),
              StageResiduals(), StageResiduals(incoming={"a": 0, "b": 1})]
    placements = place([(0, 1), (1, 2), (2, 3), (3, 4)], routes, SHARDS)
    assert [(p.previous_address, p.next_address) for p in placements] == [
        ("", "host1:7001"), ("host0:7000", "host2:7002"), ("host1:7001", "host3:7003"), ("host2:7002", "")]
    assert [p.incoming for p in placements] == [
        {}, {"a": (0, "host0:7000")}, {}, {"a": (0, "host0:7000"), "b": (1, "host1:7001")}]
    assert [p.outgoing for p in placements] == [{"a": [1, 3]}, {"b": [3]}, {}, {}]
    assert [p.consumers for p in placements] == [{"a": ["host1:7001", "host3:7003"]}, {"b": ["host3:7003"]}, {}, {}]


def test_extra_registered_shards_are_left_idle():
    placements = place([(0, 1), (1, 2)], [StageResiduals(), StageResiduals()], SHARDS)
    assert [p.shard for p in placements] == SHARDS[:2]
    assert placements[-1].next_address == ""


def test_placement_outgoing_is_a_copy_of_the_route():
    route = StageResiduals(outgoing={"r": [1]})
    placement = place([(0, 1), (1, 2)], [route, StageResiduals(incoming={"r": 0})], SHARDS[:2])[0]
    route.outgoing["s"] = [1]
    assert placement.outgoing == {"r": [1]}


def test_tied_weights_name_every_stage_holding_them_and_only_when_they_cross_stages():
    ranges = [(0, 2), (2, 4), (4, 6)]
    keys = [["0.weight"], [], ["2.weight"], ["2.weight"], [], ["0.weight"]]  # each layer's tied keys
    assert tied_stages(ranges, keys) == [{"0.weight": [0, 2]}, {}, {"0.weight": [0, 2]}]
