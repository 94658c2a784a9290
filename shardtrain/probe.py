"""`shardtrain health ADDRESS`: asks a coordinator or shard for its grpc.health.v1 status, for Docker's
HEALTHCHECK, compose's service_healthy and scripts. Exit 0 when it serves, 1 otherwise (with the reason).

TLS comes from the SHARDTRAIN_TLS_* variables (or the flags), as for any client; health needs no token.
A container runs this every few seconds, so it imports grpc and the settings only: no torch, no SDK
(about 0.12 s of CPU and 41 MiB; tests/integration/test_health.py holds it under 0.3 s and 60 MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardtrain.channels import open_channel
from shardtrain.settings import Security, add_client_security_flags, security_from


async def check(address: str, service: str, security: Security, timeout: float) -> int:
    """The status the server at `address` reports for `service` ("": the server), asked as grpc_health_probe asks:
    no token. grpc.aio.AioRpcError when it does not answer."""
    async with open_channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)).status


def main(argv: list[str] | None = None) -> int:
    """Entry point of `shardtrain health`."""
    parser = argparse.ArgumentParser(prog="shardtrain health", description=__doc__.split("\n\n")[0])
    parser.add_argument("address", help="host:port of a coordinator or a shard")
    parser.add_argument("--service", default="", help="a service's full name, e.g. shardtrain.v1.ShardService "
                                                      "(default: the server as a whole)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    add_client_security_flags(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(
            asyncio.run(check(args.address, args.service, security_from(args), args.timeout)))
    except grpc.aio.AioRpcError as error:
        print(f"{args.address}: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1
