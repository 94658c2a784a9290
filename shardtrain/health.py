"""gRPC's health checking protocol (grpc.health.v1.Health) on the coordinator and the shards, and server reflection.

The servicer and its messages are grpcio-health-checking's: protobuf holds one definition of grpc.health.v1 per
process, so a copy of our own would break every program that also imports grpc_health. A server reports SERVING
for itself ("") and for its service from the start, and NOT_SERVING for both once it shuts down
(enter_graceful_shutdown). Health calls need no token (auth.py): a probe learns only whether the server serves.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


async def add_service(server: grpc.aio.Server, service) -> grpc_health.aio.HealthServicer:
    """Serves grpc.health.v1.Health beside `service` on `server`, and server reflection over both (tools such as
    grpcurl list and describe them, with a token); the returned servicer reports their status."""
    servicer = grpc_health.aio.HealthServicer()
    await servicer.set(service.full_name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection((service.full_name, grpc_health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return servicer
