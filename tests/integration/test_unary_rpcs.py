"""The one-call-per-operation RPCs train like one process too: a client in another language that drives
the loop with Forward, FetchTensor("@output"), Backward and Step, with a residual that skips a stage."""

from __future__ import annotations

import asyncio

import torch

from client_sdk import LayerList
from shardtrain import auth, rpc, wire
from shardtrain.residuals import OUTPUT
from shardtrain.settings import Security
from shardtrain.v1 import shard_pb2
from tests.integration.training import SKIP_A_STAGE, largest_difference, regression_batches, train_locally

SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


async def train_by_calls(addresses: list[str], deployment_id: str, batches, security: Security, secret: str) -> None:
    """The loop as plain calls: what an SDK without Links would send for each step."""
    stages = [rpc.Peer(f"stage {i}", address, rpc.SHARD_SERVICE, security, timeout=30)
              for i, address in enumerate(addresses)]
    for stage in stages:
        stage.metadata = auth.with_deployment(stage.metadata, secret)
    try:
        for optimizer_step, (x, y) in enumerate(batches, start=1):
            key = shard_pb2.StepKey(deployment_id=deployment_id, step=optimizer_step)
            header = shard_pb2.ForwardHeader(key=key, requires_grad=True, zero_grad=True,
                                             after_optimizer_step=optimizer_step - 1)
            await stages[0].call("Forward", wire.framed(shard_pb2.ForwardRequest, header, {"activation": x}))
            pred = (await rpc.fetch_tensor(stages[-1], key, OUTPUT)).requires_grad_(True)
            torch.nn.functional.mse_loss(pred, y).backward()
            await stages[-1].call("Backward", wire.framed(shard_pb2.BackwardRequest, shard_pb2.BackwardHeader(key=key),
                                                          {"gradient": pred.grad}))
            step = shard_pb2.StepRequest(deployment_id=deployment_id, step=optimizer_step,
                                         optimizer_step=optimizer_step, backward_steps=[optimizer_step])
            await asyncio.gather(*(stage.call("Step", step) for stage in stages))
    finally:
        for stage in stages:
            await stage.close()


def test_forward_fetch_backward_step_calls_match_one_process(cluster4):
    torch.manual_seed(1)
    reference = LayerList(SKIP_A_STAGE)
    batches = regression_batches(steps=10, batch=8, features=3)
    model = cluster4.deploy(reference, optimizer=SGD, split_points=[2, 4])
    addresses = [placement.shard_address for placement in model.placements]
    model._io.run(train_by_calls(addresses, model.deployment_id, batches, cluster4.security, model._clients.secret))
    assert largest_difference(model.state_dict(), train_locally(reference, batches, SGD)) <= 1e-5
