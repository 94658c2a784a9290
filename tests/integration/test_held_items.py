"""A shard holds a bounded number of items waiting to run: beyond it an item is RESOURCE_EXHAUSTED, and the shard
goes on serving."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from shard_service import held
from shardtrain import errors
from shardtrain.v1 import shard_pb2
from tests.integration.training import trains_like_one_process


@pytest.mark.parametrize("own_cluster", [1], indirect=True)
def test_forwards_that_wait_for_a_step_that_never_comes_are_bounded(own_cluster):
    cluster = own_cluster
    model = cluster.deploy(nn.Sequential(nn.Linear(8, 8)), num_stages=1)
    links = model._clients._links
    count = held.MAX_HELD_ITEMS + 20

    async def flood() -> list:
        """Forwards that follow an optimizer step that never comes: each waits on the shard, holding its input."""
        calls = []
        for step in range(count):
            header = shard_pb2.ForwardHeader(key=model._clients.key(10_000 + step), after_optimizer_step=1_000_000)
            calls.append(asyncio.ensure_future(links.forward(header, torch.randn(4, 8))))
        done, pending = await asyncio.wait(calls, timeout=3)
        for call in pending:
            call.cancel()
        return [call.exception() for call in done]

    failures = model._io.run(flood())
    exhausted = [f for f in failures if isinstance(f, errors.ResourceExhausted)]
    assert len(exhausted) >= 20, failures[:3]
    assert f"at most {held.MAX_HELD_ITEMS}" in str(exhausted[0])
    assert trains_like_one_process(cluster, num_stages=1) <= 1e-5  # a new deployment trains as before
