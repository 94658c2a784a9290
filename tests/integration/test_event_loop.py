"""The SDK inside a running event loop (a Jupyter kernel, an async script): both loops work."""

from __future__ import annotations

import asyncio

import torch
from torch import nn

from tests.integration.training import regression_batches, train_remotely


def test_sdk_inside_a_running_event_loop(cluster4):
    async def main():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
        model = cluster4.deploy(net, optimizer=(torch.optim.SGD, {"lr": 0.1}), num_stages=2)
        batches = regression_batches(steps=4, batch=4, features=3)
        train_remotely(model, batches[:2])               # the synchronous loop, called from a coroutine
        for x, y in batches[2:]:                          # the explicit asynchronous loop
            pred = await model.aforward(x)
            nn.functional.mse_loss(pred, y).backward()
            await model.abackward(pred.grad)
            await model.astep()
            await model.azero_grad()
        local = torch.optim.SGD(net.parameters(), lr=0.1)
        for x, y in batches:
            nn.functional.mse_loss(net(x), y).backward()
            local.step()
            local.zero_grad()
        trained = await model.astate_dict()
        return max((trained[k] - v).abs().max().item() for k, v in net.state_dict().items())

    assert asyncio.run(main()) <= 1e-6
