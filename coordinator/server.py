"""Coordinator server wiring: build the gRPC server and serve until stopped."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import grpc

from coordinator.servicer import CoordinatorServicer
from shardtrain import health, metrics, rpc, shm
from shardtrain.lifecycle import die_with_parent, freeze_imported_objects, stop_on_sigterm, stop_reason
from shardtrain.errors import ShardtrainError
from shardtrain.settings import CoordinatorSettings

log = logging.getLogger("shardtrain.coordinator")


async def build_server(settings: CoordinatorSettings,
                       bind: str | None = None) -> tuple[grpc.aio.Server, int, CoordinatorServicer]:
    """Starts a coordinator on `bind` (default settings.bind; port 0 picks one); returns it, its port and servicer."""
    server = rpc.new_server(settings.security)
    address = bind or settings.bind
    port = rpc.bind(server, address, settings.security)
    servicer = CoordinatorServicer(settings, f"{address.rsplit(':', 1)[0]}:{port}")
    rpc.add_service(server, servicer, rpc.COORDINATOR_SERVICE)
    servicer.health = await health.add_service(server, rpc.COORDINATOR_SERVICE)
    await server.start()
    return server, port, servicer


async def serve(settings: CoordinatorSettings) -> None:
    """Runs the coordinator until cancelled (or SIGTERM), announcing readiness on stdout."""
    stop_on_sigterm()
    scraped = metrics.serve_for(settings, "coordinator")  # before the server: it counts requests from the first
    server, port, servicer = await build_server(settings)
    print(json.dumps({"event": "ready", "service": "coordinator", "port": port, **scraped}), flush=True)
    try:
        await server.wait_for_termination()
    finally:
        await servicer.health.enter_graceful_shutdown()
        await server.stop(grace=1)


def run(settings: CoordinatorSettings) -> int:
    """Serves the coordinator with parsed settings until stopped; the exit status."""
    die_with_parent(settings.parent_pid)
    freeze_imported_objects()
    shm.sweep()  # segments left by shardtrain processes that were killed
    try:
        asyncio.run(serve(settings))
    except ShardtrainError as error:
        print(f"coordinator: {error}", file=sys.stderr)
        log.info("stopped: %s", stop_reason(error))
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError) as stopped:  # Ctrl-C, or SIGTERM (stop_on_sigterm)
        log.info("stopped: %s", stop_reason(stopped))
    else:
        log.info("stopped: %s", stop_reason(None))
    return 0
