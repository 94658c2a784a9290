"""gRPC's health checking protocol on the coordinator and the shards, open to probes without a token; server
reflection, for token holders; and `shardtrain health`, light enough to run every few seconds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client_sdk import Cluster
from shardtrain import channels, errors, probe
from shardtrain.settings import Security

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


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
    assert answers[:4] == [(grpc.StatusCode.OK, SERVING)] * 4
    assert answers[4] == (grpc.StatusCode.NOT_FOUND, -1)
    with pytest.raises(errors.Unauthenticated, match="auth token"):  # the rest still takes the token
        Cluster.connect(cluster.address, security=Security())


@contextlib.contextmanager
def coordinator_process():
    """`shardtrain coordinator` on a loopback port the OS picks, as its own process; yields it and its address once
    it says it is ready."""
    process = subprocess.Popen(["shardtrain", "coordinator", "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    try:
        yield process, f"127.0.0.1:{json.loads(process.stdout.readline())['port']}"
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(30)


def test_watch_sends_serving_then_not_serving_as_the_server_stops():
    with coordinator_process() as (process, address), grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="shardtrain.v1.CoordinatorService"), timeout=60)
        assert next(watch).status == SERVING
        process.send_signal(signal.SIGTERM)
        assert next(watch).status == NOT_SERVING
        assert process.wait(30) == 0


@pytest.mark.parametrize("first, second", [("client_sdk", "grpc_health.v1.health_pb2"),
                                           ("grpc_health.v1.health_pb2", "client_sdk")])
def test_the_sdk_and_grpc_health_checking_import_into_one_process_in_either_order(first, second):
    """Applications that serve standard health checks themselves can use the SDK, and the services' modules."""
    imported = subprocess.run([sys.executable, "-c", f"import {first}, {second}, coordinator.server, "
                                                     "shard_service.server"],
                              capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr[-2000:]


# Runs `shardtrain ARGS` as the console script does, then says which heavy packages it had imported.
IMPORTS_OF = r"""
import atexit, json, sys
heavy = {"torch", "client_sdk", "coordinator", "shard_service"}
atexit.register(lambda: print(json.dumps(sorted(heavy & {name.split(".")[0] for name in sys.modules})),
                              file=sys.stderr))
from shardtrain.cli import main
sys.exit(main(sys.argv[1:]))
"""
# Runs a command and reports its exit, output, wall time, and the CPU time and peak memory of it alone.
COST_OF = r"""
import json, resource, subprocess, sys, time
started = time.monotonic()
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
                  "wall_s": time.monotonic() - started, "cpu_s": usage.ru_utime + usage.ru_stime,
                  "max_rss_mib": usage.ru_maxrss / 1024}))
"""


def test_shardtrain_health_and_the_other_tensor_free_commands_import_neither_torch_nor_the_sdk():
    with coordinator_process() as (_, address):
        for args in (["health", address], ["health", "--help"], ["--version"], ["--help"], ["coordinator", "--help"],
                     ["shard", "--help"]):
            done = subprocess.run([sys.executable, "-c", IMPORTS_OF, *args], capture_output=True, text=True,
                                  timeout=60)
            assert done.returncode == 0, (args, done.stderr[-2000:])
            assert json.loads(done.stderr.splitlines()[-1]) == [], f"shardtrain {' '.join(args)} imported them"


def test_a_health_probe_costs_under_a_third_of_a_second_of_cpu_and_60_mib():
    """Container health checks run it every few seconds with a few seconds to answer (docker/). CPU time, not wall
    time: it holds on a busy host, where waiting for a core is not the probe's cost."""
    with coordinator_process() as (_, address):
        costs = [json.loads(subprocess.run([sys.executable, "-c", COST_OF, "shardtrain", "health", address],
                                           capture_output=True, text=True, timeout=60).stdout) for _ in range(3)]
    for cost in costs:
        assert (cost["returncode"], cost["stdout"].strip()) == (0, f"{address}: SERVING"), cost["stderr"]
    print("shardtrain health:", ", ".join(f"{c['cpu_s']:.3f} s CPU, {c['wall_s']:.3f} s wall, "
                                          f"{c['max_rss_mib']:.1f} MiB" for c in costs))
    assert sorted(c["cpu_s"] for c in costs)[1] < 0.3, costs  # the median of three
    assert max(c["max_rss_mib"] for c in costs) < 60, costs


async def reflect(address: str, security: Security, request: dict | None) -> list:
    """The answers of server reflection (grpc.reflection.v1alpha, as grpcurl asks) to one request (None: the stream
    opens and closes with none, so a refusal does not race a request still being written: grpc then reports
    INTERNAL rather than the server's status)."""
    async with channels.open_channel(address, security) as channel:
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
