"""A deploy whose captured program reaches for the shard's host is refused, and the cluster keeps training."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from client_sdk import layers as layer_tools
from shardtrain import errors, operators
from shardtrain.v1 import coordinator_pb2, shard_pb2
from tests.integration.training import trains_like_one_process


class Counts(nn.Module):
    """Adds the sum of seven ones: the node a hostile client turns into from_file(path, size=7)."""

    def forward(self, x):
        return x + torch.ones(7, dtype=torch.uint8).float().sum()


class CountsInABranch(nn.Module):
    """Counts inside one of torch.cond's branches: the ones() sits in a graph the cond node carries."""

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda v: Counts()(v), lambda v: v - 1, (x,))


def ones_in_a_branch(tree: dict) -> dict:
    cond = next(n for n in tree["graph_module"]["graph"]["nodes"] if n["target"] == "torch.ops.higher_order.cond")
    return next(n for graph in operators.subgraphs(cond) for n in graph["graph"]["nodes"]
                if n["target"] == "torch.ops.aten.ones.default")


def ones_at_the_top(tree: dict) -> dict:
    return next(n for n in tree["graph_module"]["graph"]["nodes"] if n["target"] == "torch.ops.aten.ones.default")


def hostile_request(path: str, shared: bool, middle: nn.Module | None = None,
                    ones=ones_at_the_top) -> coordinator_pb2.DeployRequest:
    """What the SDK would deploy for Linear -> Counts -> Linear (or `middle` in Counts' place), with the ones()
    that `ones` finds made from_file(path)."""
    net = nn.Sequential(nn.Linear(3, 4), middle or Counts(), nn.Linear(4, 1))
    module = layer_tools.as_module(net)
    layers = layer_tools.capture_model(module, layer_tools.layers_of(module), None)
    tree = json.loads(layers[1].program)
    node = ones(tree)
    node["target"] = "torch.ops.aten.from_file.default"
    node["inputs"] = [{"name": "filename", "arg": {"as_string": path}, "kind": 1},
                      {"name": "shared", "arg": {"as_bool": shared}, "kind": 1},
                      {"name": "size", "arg": {"as_int": 7}, "kind": 1}]
    layers[1].program = json.dumps(tree).encode()
    return coordinator_pb2.DeployRequest(layers=layers, optimizer=shard_pb2.OptimizerSpec(name="SGD",
                                                                                           kwargs_json='{"lr": 0.1}'),
                                         partition=coordinator_pb2.PartitionSpec(num_stages=3))


@pytest.mark.parametrize("shared", [False, True])
def test_a_program_that_opens_a_file_is_refused_and_training_goes_on(cluster4, tmp_path, shared):
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET!")
    request = hostile_request(str(secret), shared)
    with pytest.raises(errors.InvalidArgument, match=r"from_file.default'?, which reads or writes outside"):
        cluster4._io.run(cluster4._deploy_call(request))  # as this client's own deploys, with its last secret
    assert secret.read_bytes() == b"SECRET!"

    assert trains_like_one_process(cluster4, num_stages=3) <= 1e-5


def test_a_program_that_opens_a_file_inside_a_cond_branch_is_refused_and_training_goes_on(cluster4, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET!")
    request = hostile_request(str(secret), False, CountsInABranch(), ones_in_a_branch)
    with pytest.raises(errors.InvalidArgument, match=r"from_file.default'?, which reads or writes outside .*"
                                                     r"\(in graph 'true_graph_0' of torch.ops.higher_order.cond\)"):
        cluster4._io.run(cluster4._deploy_call(request))
    assert secret.read_bytes() == b"SECRET!"
    assert trains_like_one_process(cluster4, num_stages=3) <= 1e-5


@pytest.mark.parametrize("target, why", [
    ("torch.ops.aten._print.default", "reads or writes outside the computation"),
    ("torch.ops.aten.set_.source_Storage", "re-points a tensor's memory"),
    ("torch.ops.aten.empty_like.default", "uninitialized memory"),
    ("torch.ops.aten.mkldnn_convolution.default", "backend kernel"),
    ("torch.ops.aten._native_batch_norm_legit_no_training.default", "internal operator"),
    ("torch.ops.c10d.allreduce_.default", "only aten operators"),
    ("torch.ops._c10d_functional.all_reduce.default", "only aten operators"),
    ("torch.ops.mylib.custom.default", "only aten operators"),
    ("torch.ops.higher_order.run_with_rng_state", "sets the random generator's state"),
    ("torch.ops.higher_order.invoke_subgraph", "not one of the higher-order operators the rule admits"),
])
def test_every_family_the_rule_refuses_is_refused_from_a_raw_client_and_training_goes_on(cluster4, target, why):
    request = hostile_request("/etc/hostname", False)
    tree = json.loads(request.layers[1].program)
    node = next(n for n in tree["graph_module"]["graph"]["nodes"] if n["target"] == "torch.ops.aten.from_file.default")
    node["target"] = target
    request.layers[1].program = json.dumps(tree).encode()
    with pytest.raises(errors.InvalidArgument, match=why):
        cluster4._io.run(cluster4._deploy_call(request))
    assert trains_like_one_process(cluster4, num_stages=3) <= 1e-5
