"""gRPC's health checking protocol on the coordinator and the shards, open to probes without a token; and server
reflection, for token holders."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client_sdk import Cluster
from shardtrain import errors, health, probe, rpc
from shardtrain.settings import Security
from shardtrain.v1 import health_pb2


async def check(address: str, service: str) -> tuple[grpc.StatusCode, int]:
    """A probe's Check, made as grpc_health_probe makes it: no token."""
    try:
        return grpc.StatusCode.OK, await probe.check(address, service, Security(), 5)
    except grpc.aio.AioRpcError as error:
        return error.code(), -1


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


async def reflect(address: str, security: Security, request: dict | None) -> list:
    """The answers of server reflection (grpc.reflection.v1alpha, as grpcurl asks) to one request (None: the stream
    opens and closes with none, so a refusal does not race a request still being written: grpc then reports
    INTERNAL rather than the server's status)."""
    async with rpc.open_channel(address, security) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [] if request is None else [reflection_pb2.ServerReflectionRequest(**request)]
        call = stub.ServerReflectionInfo(iter(requests),
                                         metadata=security.metadata, timeout=5)
        return [answer async for answer in call]


@pytest.mark.parametrize("own_cluster", [1], indirect=True)
def test_reflection_lists_and_describes_the_services_to_a_token_holder(own_cluster):
    cluster = own_cluster
    shard = cluster.shards()[0].address

    async def ask() -> tuple:
        listed = [await reflect(address, cluster.security, {"list_services": ""})
                  for address in (cluster.address, shard)]
        files = await reflect(shard, cluster.security, {"file_containing_symbol": "shardtrain.v1.ShardService"})
        try:
            await reflect(shard, Security(), None)
            refused = None
        except grpc.aio.AioRpcError as error:
            refused = error.code()
        return listed, files, refused
    listed, files, refused = cluster._io.run(ask())
    names = [{service.name for service in answer[0].list_services_response.service} for answer in listed]
    assert {"shardtrain.v1.CoordinatorService", "grpc.health.v1.Health"} <= names[0]
    assert {"shardtrain.v1.ShardService", "grpc.health.v1.Health"} <= names[1]
    described = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for raw in files[0].file_descriptor_response.file_descriptor_proto]
    methods = {m.name for f in described for s in f.service if s.name == "ShardService" for m in s.method}
    assert {"Forward", "Backward", "Step", "GradientNorm", "Link"} <= methods
    assert refused == grpc.StatusCode.UNAUTHENTICATED
