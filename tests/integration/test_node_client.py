"""A Node.js client built from protos/ alone (tests/node: @grpc/grpc-js, @grpc/proto-loader, protobufjs 8) talks
to a real local cluster and gets exactly what the Python SDK gets: the shards, their stages, a forward's output
and a stage's optimizer state."""

from __future__ import annotations

import base64
import json
import subprocess

import pytest
import torch
from torch import nn

from client_sdk import Cluster
from shardtrain import wire
from shardtrain.v1 import tensor_pb2
from tests.integration.training import regression_batches
from tests.node_tools import node_tools

@pytest.fixture(scope="module")
def node_client() -> list[str]:
    """The command that runs the client, its packages installed from the lockfile the first time."""
    return ["node", str(node_tools() / "client.js")]


def tensor_of(encoded: dict) -> torch.Tensor:
    dtype = wire.torch_dtype(tensor_pb2.DType.Value(encoded["dtype"]))
    data = bytearray(base64.b64decode(encoded["data"]))
    return torch.frombuffer(data, dtype=dtype).reshape(encoded["shape"]) if data else \
        torch.zeros(encoded["shape"], dtype=dtype)


def test_a_node_client_gets_the_shards_a_forward_and_optimizer_state_exactly_as_the_python_sdk(node_client):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    with Cluster.local(num_shards=2) as cluster:
        model = cluster.deploy(net, optimizer=(torch.optim.Adam, {"lr": 1e-2}), num_stages=2)
        for x, y in regression_batches(steps=3, batch=8, features=4, outputs=3):
            model.train_step(x, y, "MSELoss")
        model.synchronize()
        x = torch.randn(5, 4)
        with torch.no_grad():
            expected = model(x)
        optimizer = model._io.run(model._clients.stage_optimizer_state(0))
        request = {"coordinator": cluster.address, "stages": [p.shard_address for p in model.placements],
                   "token": cluster.security.token, "deployment_id": model.deployment_id,
                   "secret": model._clients.secret, "input": x.tolist()}
        run = subprocess.run(node_client, input=json.dumps(request), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        answer = json.loads(run.stdout)
        assert sorted(answer["shards"]) == sorted(cluster._services.shard_addresses)
        assert [(d["address"], d["stage"], d["deployment_id"]) for d in answer["described"]] == [
            (p.shard_address, p.stage, model.deployment_id) for p in model.placements]
        assert torch.equal(tensor_of(answer["output"]["@output"]), expected)  # the same bits
        assert answer["optimizer"]["layout"] == json.loads(optimizer.layout())
        tensors = {name: tensor_of(value) for name, value in answer["optimizer"]["tensors"].items()}
        assert sorted(tensors) == sorted(optimizer.tensors) == ["0.bias/exp_avg", "0.bias/exp_avg_sq", "0.bias/step",
                                                                "0.weight/exp_avg", "0.weight/exp_avg_sq",
                                                                "0.weight/step"]
        assert all(torch.equal(tensors[name], optimizer.tensors[name]) for name in tensors)
