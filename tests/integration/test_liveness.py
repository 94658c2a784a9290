"""The coordinator places stages only on shards that answer, and a shard keeps its registration alive."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from coordinator.server import build_server
from shard_service.server import keep_registered
from shardtrain.settings import CoordinatorSettings, Security, ShardSettings, Timeouts
from shardtrain.v1 import coordinator_pb2
from tests.integration.training import trains_like_one_process


@pytest.mark.parametrize("own_cluster", [2], indirect=True)
def test_a_registration_that_does_not_answer_is_forgotten_at_deploy_and_the_deploy_goes_on(own_cluster):
    cluster = own_cluster
    rogue = coordinator_pb2.RegisterShardRequest(address="127.0.0.1:1", device="cpu")  # nothing listens there
    cluster._io.run(cluster._coordinator.call("RegisterShard", rogue))
    assert len(cluster.shards()) == 3
    # Every registered shard by default: before, the rogue got a stage and every later deploy failed.
    assert trains_like_one_process(cluster, num_stages=0) <= 1e-5
    assert sorted(s.address for s in cluster.shards()) == sorted(cluster._services.shard_addresses)


def test_a_shard_registers_again_at_every_heartbeat():
    async def scenario() -> list[float]:
        coordinator = CoordinatorSettings(security=Security(token="t"))
        server, port, servicer = await build_server(coordinator)
        shard = ShardSettings(coordinator=f"127.0.0.1:{port}", security=Security(token="t"),
                              timeouts=dataclasses.replace(Timeouts(), heartbeat=0.05))
        beating = asyncio.ensure_future(keep_registered(shard, "127.0.0.1:5"))
        heard = []
        try:
            for _ in range(4):
                await asyncio.sleep(0.1)
                heard.append(servicer.registry._heard.get("127.0.0.1:5", 0.0))
        finally:
            beating.cancel()
            await server.stop(None)
        return heard
    heard = asyncio.run(scenario())
    assert heard[0] > 0 and all(later > earlier for earlier, later in zip(heard, heard[1:])), heard
