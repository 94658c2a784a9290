"""A program shipped by a raw client cannot make a shard read or write memory it does not own: internal operators that
skip their bounds checks are refused, and every admitted family with lying shapes, wrong dtypes or empty weights is
refused cleanly before it runs; the shards keep serving and the next deployment trains as one process."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from client_sdk import layers as layer_tools
from shardtrain import errors
from shardtrain.v1 import coordinator_pb2, shard_pb2
from tests.integration.training import trains_like_one_process


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.project = nn.Linear(8, 8)

    def forward(self, x):
        q = self.project(x).reshape(x.shape[0], 2, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, q, q).reshape(x.shape[0], 8)


class Gather(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x + self.table.index_select(0, torch.arange(8) % 8).sum(0)


# One module per operator family the rule admits, each taking and giving [batch, 8]; the weight a hostile client
# lies about, and what it makes it.
FAMILIES = {
    "pointwise and matmul (linear)": (nn.Linear(8, 8), "weight"),
    "batch norm, training": (nn.BatchNorm1d(8).train(), "running_mean"),
    "batch norm, eval": (nn.BatchNorm1d(8).eval(), "running_var"),
    "layer norm": (nn.LayerNorm(8), "weight"),
    "group norm": (nn.GroupNorm(2, 8), "bias"),
    "embedding-like gather (index_select)": (Gather(), "table"),
    "attention": (Attention(), "project.weight"),
}
LIES = {"one element": lambda shape: [1] * len(shape), "empty": lambda shape: [0, *shape[1:]],
        "wider": lambda shape: [shape[0] * 4, *shape[1:]]}


def request_with(family: str, lie) -> coordinator_pb2.DeployRequest:
    """What the SDK deploys for Linear -> <family> -> Linear, with the middle layer's weight declared as `lie`."""
    module, key = FAMILIES[family]
    net = nn.Sequential(nn.Linear(3, 8), module, nn.Linear(8, 1))
    layers = layer_tools.capture_model(net, layer_tools.layers_of(net), torch.randn(4, 3))
    tree = json.loads(layers[1].program)
    graph = tree["graph_module"]
    for spec in graph["signature"]["input_specs"]:
        (kind, body), = spec.items()
        if kind in ("parameter", "buffer") and body[f"{kind}_name"] == f"layer.{key}":
            lie(graph["graph"]["tensor_values"][body["arg"]["name"]])
    layers[1].program = json.dumps(tree).encode()
    return coordinator_pb2.DeployRequest(layers=layers, optimizer=shard_pb2.OptimizerSpec(name="SGD",
                                                                                           kwargs_json='{"lr": 0.1}'),
                                         partition=coordinator_pb2.PartitionSpec(num_stages=3))


def resized(make):
    def lie(value: dict) -> None:
        value["sizes"] = [{"as_int": size} for size in make([size["as_int"] for size in value["sizes"]])]
    return lie


def retyped(value: dict) -> None:
    value["dtype"] = 1 if value["dtype"] != 1 else 7  # uint8 where the family computes in float32


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_admitted_family_with_lying_shapes_or_dtypes_is_refused_and_the_shards_serve_on(cluster4, family):
    # A table wider than its indices reach is a lie nothing reads past, and an empty one fails index_select's own
    # check of the indices it is given when it runs: only a narrower table must be refused up front.
    lies = [make for name, make in LIES.items() if not family.startswith("embedding") or name == "one element"]
    for lie in [*(resized(make) for make in lies), retyped]:
        with pytest.raises(errors.InvalidArgument, match=r"captured program|layer 1: "):
            cluster4._io.run(cluster4._deploy_call(request_with(family, lie)))
    assert trains_like_one_process(cluster4, num_stages=3) <= 1e-5


@pytest.mark.parametrize("internal", ["_native_batch_norm_legit_no_training", "_native_batch_norm_legit",
                                      "native_batch_norm", "_native_batch_norm_legit_functional"])
def test_internal_batch_norms_that_skip_the_bounds_check_are_refused(cluster4, internal):
    request = request_with("batch norm, eval", resized(lambda shape: [1]))
    tree = json.loads(request.layers[1].program)
    node = next(n for n in tree["graph_module"]["graph"]["nodes"] if "batch_norm" in n["target"])
    node["target"] = f"torch.ops.aten.{internal}.default"
    request.layers[1].program = json.dumps(tree).encode()
    with pytest.raises(errors.InvalidArgument, match="internal operator that skips its public form's argument checks"):
        cluster4._io.run(cluster4._deploy_call(request))
    assert trains_like_one_process(cluster4, num_stages=3) <= 1e-5
