"""gRPC's health checking protocol on the coordinator and the shards: open to probes without a token."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from client_sdk import Cluster
from shardtrain import errors, health, rpc
from shardtrain.settings import Security
from shardtrain.v1 import health_pb2


async def check(address: str, service: str) -> tuple[grpc.StatusCode, int]:
    """A probe's Check, made as grpc_health_probe makes it: no token."""
    channel = rpc.open_channel(address, Security())
    try:
        call = channel.unary_unary("/grpc.health.v1.Health/Check",
                                   request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                   response_deserializer=health_pb2.HealthCheckResponse.FromString)
        response = await call(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return grpc.StatusCode.OK, response.status
    except grpc.aio.AioRpcError as error:
        return error.code(), -1
    finally:
        await channel.close()


@pytest.mark.parametrize("own_cluster", [1], indirect=True)
def test_the_coordinator_and_a_shard_answer_health_checks_without_a_token(own_cluster):
    cluster = own_cluster
    shard = cluster.shards()[0].address
    async def probes() -> list:
        return await asyncio.gather(
            check(cluster.address, ""), check(cluster.address, "shardtrain.v1.CoordinatorService"),
            check(shard, ""), check(shard, "shardtrain.v1.ShardService"), check(shard, "no.such.Service"))
    answers = cluster._io.run(probes())
    assert answers[:4] == [(grpc.StatusCode.OK, health.SERVING)] * 4
    assert answers[4] == (grpc.StatusCode.NOT_FOUND, -1)
    with pytest.raises(errors.Unauthenticated, match="auth token"):  # the rest still takes the token
        Cluster.connect(cluster.address, security=Security())


def test_watch_sends_the_status_then_each_change():
    async def scenario() -> list[int]:
        servicer = health.HealthServicer(("shardtrain.v1.ShardService",))
        watch = servicer.Watch(health_pb2.HealthCheckRequest(service="shardtrain.v1.ShardService"), None)
        first = await anext(watch)
        later = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0)
        servicer.set_all(health.NOT_SERVING)
        return [first.status, (await asyncio.wait_for(later, 5)).status]
    assert asyncio.run(scenario()) == [health.SERVING, health.NOT_SERVING]
