"""A Node.js client built from protos/ alone (tests/node: @grpc/grpc-js, @grpc/proto-loader, protobufjs 8) talks
to a real local cluster and gets exactly what the Python SDK gets: the shards, their stages, a forward's output
and a stage's optimizer state; and, over TLS with a token, it trains a model the Python side deployed with the
per-call RPCs alone, as one Python process trains it."""

from __future__ import annotations

import base64
import copy
import json
import subprocess

import pytest
import torch
from torch import nn

from client_sdk import Cluster, LayerList
from shardtrain import wire
from shardtrain.v1 import tensor_pb2
from tests.certificates import needs_openssl, tls_security
from tests.integration.training import SKIP_A_STAGE, largest_difference, regression_batches
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


def encoded(tensor: torch.Tensor) -> dict:
    """A float32 tensor as the client reads one."""
    data = tensor.to(torch.float32).contiguous().numpy().tobytes()
    return {"shape": list(tensor.shape), "dtype": "DTYPE_FLOAT32", "data": base64.b64encode(data).decode()}


def run_client(command: list[str], request: dict) -> dict:
    run = subprocess.run(command, input=json.dumps(request), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


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
        answer = run_client(node_client, request)
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


@needs_openssl
def test_a_node_client_trains_a_deployed_model_over_tls_with_a_token_as_one_python_process(node_client, tmp_path):
    """Forward, FetchTensor, Backward (the MSE gradient computed in JS) and Step per batch, on a model whose residual
    crosses from stage 0 to stage 1; then ReadState of both stages. Losses, the residual and the input's gradient
    at step 1 and the final weights are those of the same training in this process; calls without the token, the
    deployment secret or TLS are refused, and so is a FetchTensor of a name the stage does not have."""
    torch.manual_seed(6)
    reference = LayerList(SKIP_A_STAGE)
    batches = regression_batches(steps=4, batch=8, features=3)
    sgd = {"lr": 0.1, "momentum": 0.9}
    security = tls_security(tmp_path)
    with Cluster.local(num_shards=2, security=security) as cluster:
        model = cluster.deploy(reference, optimizer=(torch.optim.SGD, sgd), split_points=[2])
        assert [(p.first_layer, p.end_layer) for p in model.placements] == [(0, 2), (2, 6)]  # layer 0 to 4: crosses
        request = {"coordinator": cluster.address, "token": security.token, "ca": security.tls_ca,
                   "deployment_id": model.deployment_id, "secret": model._clients.secret,
                   "batches": [{"x": encoded(x), "y": encoded(y)} for x, y in batches]}
        answer = run_client(node_client, request)

    local = copy.deepcopy(reference)
    with torch.no_grad():
        skip = list(local.children())[0](batches[0][0])  # layer 0's output, which layer 4 reads on stage 1
    optimizer = torch.optim.SGD(local.parameters(), **sgd)
    losses, input_gradient = [], None
    for step, (x, y) in enumerate(batches, start=1):
        x = x.clone().requires_grad_(step == 1)
        loss = torch.nn.functional.mse_loss(local(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        input_gradient = x.grad if step == 1 else input_gradient
    assert answer["losses"] == pytest.approx(losses, abs=1e-5)
    assert torch.allclose(tensor_of(answer["input_gradient"]), input_gradient, atol=1e-6)
    assert torch.allclose(tensor_of(answer["skip"]), skip, atol=1e-6)
    weights = {name: tensor_of(value) for name, value in answer["weights"].items()}
    assert largest_difference(dict(sorted(weights.items())), dict(sorted(local.state_dict().items()))) <= 1e-5
    with torch.no_grad():
        assert torch.allclose(tensor_of(answer["after"]), local(batches[0][0]), atol=1e-5)
    assert answer["refused"] == {"no_token": "UNAUTHENTICATED", "no_token_stage": "UNAUTHENTICATED",
                                 "no_secret": "PERMISSION_DENIED",
                                 "plaintext": "UNAVAILABLE", "unknown": "INVALID_ARGUMENT"}
