"""gRPC's health checking protocol (grpc.health.v1.Health) for the coordinator and the shards.

A server reports SERVING for itself ("") and for its service once it serves, and NOT_SERVING while it
shuts down. Health calls need no token (auth.py): a probe learns only whether the server serves.
"""

from __future__ import annotations

import asyncio

import grpc

from shardtrain.v1 import health_pb2

SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer:
    """The serving status of a server and its services, answered to Check and streamed to Watch."""

    def __init__(self, services: tuple[str, ...]):
        self.location = "health"
        self._status = {name: SERVING for name in ("", *services)}
        self._changed = asyncio.Event()

    def set_all(self, status: int) -> None:
        """Sets every service's status (NOT_SERVING as the server shuts down); watchers hear at once."""
        self._status = dict.fromkeys(self._status, status)
        self._changed.set()
        self._changed = asyncio.Event()

    async def Check(self, request, context):
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"health: no service {request.service[:200]!r} here; "
                                                           f"known: {sorted(self._status)}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        while True:
            changed = self._changed
            yield health_pb2.HealthCheckResponse(status=self._status.get(request.service, SERVICE_UNKNOWN))
            await changed.wait()
