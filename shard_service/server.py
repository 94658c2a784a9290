"""Shard server wiring: build the gRPC server, register with the coordinator, serve until stopped."""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time

import grpc
import torch

from shard_service.device import Device, compute_kind, stage_memory
from shard_service.servicer import ShardServicer
from shardtrain import addresses, carrier, health, metrics, rpc, shm
from shardtrain.lifecycle import (die_with_parent, freeze_imported_objects, keep_freed_memory, stop_on_sigterm,
                                  stop_reason)
from shardtrain.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ShardtrainError, Unavailable
from shardtrain.settings import ShardSettings
from shardtrain.v1 import coordinator_pb2

log = logging.getLogger("shardtrain.shard")


async def build_server(settings: ShardSettings, bind: str | None = None,
                       device: Device | None = None) -> tuple[grpc.aio.Server, int, ShardServicer]:
    """Starts a shard server on `bind` (default settings.bind; port 0 picks one), computing on `device` (its own
    by default); returns it, its port and servicer."""
    server = rpc.new_server(settings.security)
    port = rpc.bind(server, bind or settings.bind, settings.security)
    servicer = ShardServicer(settings, _advertised(settings.advertise, bind or settings.bind, port), device)
    rpc.add_service(server, servicer, rpc.SHARD_SERVICE)
    servicer.health = await health.add_service(server, rpc.SHARD_SERVICE)
    await server.start()
    return server, port, servicer


def _advertised(advertise: str, bind: str, port: int) -> str:
    """The address peers reach this shard at: `advertise`, whose port 0 stands for the bound `port` (shards
    that let the OS pick ports still advertise a host name), or else the bound host and port."""
    if not advertise:
        return f"{_reachable_host(bind)}:{port}"
    host, _, advertised_port = advertise.rpartition(":")
    return f"{host}:{port}" if advertised_port == "0" else advertise


def _reachable_host(bind: str) -> str:
    """The host part of a bind address, or this machine's name when bound to every interface."""
    host = bind.rsplit(":", 1)[0]
    return socket.gethostname() if host in ("0.0.0.0", "[::]", "") else host


async def keep_registered(settings: ShardSettings, address: str, instance: str = "", group: str = "",
                          control_key: str = "") -> None:
    """Registers again every settings.timeouts.heartbeat seconds: the coordinator forgets a shard it has not heard
    from for settings.timeouts.expiry."""
    while True:
        await asyncio.sleep(settings.timeouts.heartbeat)
        try:
            await register(settings, address, instance, group, control_key)
        except ShardtrainError as error:  # the coordinator is away: try again at the next beat
            log.warning("could not renew the registration with %s: %s", settings.coordinator, error)


async def register(settings: ShardSettings, address: str, instance: str = "", group: str = "",
                   control_key: str = "") -> str:
    """Registers with the coordinator as `instance` (this shard's random name) of device group `group` (the
    shards of this process, when it serves several), retrying until it answers or settings.timeouts.connect runs
    out. The device's memory is split evenly between them."""
    coordinator = rpc.Peer(f"coordinator at {settings.coordinator}", settings.coordinator,
                           rpc.COORDINATOR_SERVICE, settings.security,
                           settings.timeouts.control)
    request = coordinator_pb2.RegisterShardRequest(address=address, device=settings.device,
                                                   memory_bytes=stage_memory(settings), instance=instance,
                                                   device_group=group, control_key=control_key,
                                                   compute=compute_kind(settings))
    deadline, delay = time.monotonic() + settings.timeouts.connect, 0.1
    try:
        while True:
            try:
                return (await coordinator.call("RegisterShard", request)).shard_id
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
    finally:
        await coordinator.close()


FROM_STDIN = "-"  # --coordinator -: the address comes on standard input


async def coordinator_from_stdin(timeout: float) -> str:
    """--coordinator -: the coordinator's host:port from standard input's first line, read once this shard serves.
    A launcher that starts the coordinator and its shards at once (Cluster.local) writes it there when the
    coordinator serves, so neither waits for the other's start-up. DeadlineExceeded after `timeout` seconds."""
    try:
        line = await asyncio.wait_for(_first_line(sys.stdin.fileno()), timeout)
    except TimeoutError:
        raise DeadlineExceeded(f"--coordinator -: no coordinator address came on standard input within "
                               f"{timeout:g} s") from None
    if not addresses.is_host_port(line):
        raise InvalidArgument(f"--coordinator -: standard input's first line must be the coordinator's HOST:PORT, "
                              f"got {line[:80]!r}")
    return line


async def _first_line(fd: int) -> str:
    """The first line readable on `fd`, without a thread (one blocked in a read would outlive a stop)."""
    loop, data = asyncio.get_running_loop(), b""
    while b"\n" not in data:
        readable = loop.create_future()
        try:
            loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        except PermissionError:  # a regular file: reads do not block
            pass
        else:
            try:
                await readable
            finally:
                loop.remove_reader(fd)
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace").strip()


async def serve(settings: ShardSettings) -> None:
    """Runs this process's shards (settings.virtual_stages of them, on one device) until cancelled: serve,
    register, announce readiness on stdout. SIGTERM cancels it."""
    stop_on_sigterm()
    scraped = metrics.serve_for(settings, "shard")  # before the servers: they count requests from the first
    device = Device()
    group = secrets.token_hex(8) if settings.virtual_stages > 1 else ""
    shards = []
    try:
        for index in range(settings.virtual_stages):
            own = dataclasses.replace(settings, advertise=_moved(settings.advertise, index))
            shards.append(await build_server(own, _moved(settings.bind, index), device))
        if settings.coordinator == FROM_STDIN:
            settings = dataclasses.replace(settings, coordinator=await coordinator_from_stdin(
                settings.timeouts.connect))
        ids = [await register(settings, servicer.address, servicer.instance, group, servicer.control_key)
               for _, _, servicer in shards]
        first = shards[0][2]
        ready = {"event": "ready", "service": "shard", "address": first.address, "port": shards[0][1],
                 "shard_id": ids[0]}
        if len(shards) > 1:
            ready.update(addresses=[servicer.address for _, _, servicer in shards], shard_ids=ids)
        print(json.dumps({**ready, **scraped}), flush=True)
        heartbeats = [asyncio.ensure_future(keep_registered(settings, servicer.address, servicer.instance, group,
                                                            servicer.control_key))
                      for _, _, servicer in shards]
        try:
            await asyncio.gather(*(server.wait_for_termination() for server, _, _ in shards))
        finally:
            for heartbeat in heartbeats:
                heartbeat.cancel()
    finally:
        for server, _, servicer in shards:
            await servicer.health.enter_graceful_shutdown()
            await servicer.close()
            await server.stop(grace=1)
        device.close()


def _moved(address: str, index: int) -> str:
    """host:port with the port moved on by `index`, for a process's index-th shard; port 0 (each picks its own)
    and an empty address stay as they are."""
    host, _, port = address.rpartition(":")
    return address if not index or not port.isdigit() or int(port) == 0 else f"{host}:{int(port) + index}"


def flush_denormals() -> None:
    """Makes this thread's CPU arithmetic treat denormal floats as zero (FailedPrecondition where the CPU cannot).

    The flag is per thread, and a thread starts with its creator's: set before the compute thread and
    any intra-op thread pool exist, it holds for every thread that runs stage work.
    """
    if not torch.set_flush_denormal(True):
        raise FailedPrecondition("--flush-denormal on: this CPU cannot flush denormal floats to zero "
                                 "(torch.set_flush_denormal needs x86 with SSE3 or ARM); start the shard "
                                 "with --flush-denormal off")
    log.info("CPU arithmetic flushes denormal floats to zero")


def run(settings: ShardSettings) -> int:
    """Serves one shard (or --shards of them) with parsed settings until stopped; the exit status."""
    die_with_parent(settings.parent_pid)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: every thread's stack into the log
    keep_freed_memory()
    freeze_imported_objects()
    shm.sweep()  # segments left by shardtrain processes that were killed
    carrier.sweep()  # and their local-link sockets
    if settings.threads:
        torch.set_num_threads(settings.threads)  # for this thread; the compute thread sets its own
    try:
        if settings.flush_denormal:
            flush_denormals()  # before serve() starts any thread that computes
        asyncio.run(serve(settings))
    except ShardtrainError as error:
        print(f"shard: {error}", file=sys.stderr)
        log.info("stopped: %s", stop_reason(error))
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError) as stopped:  # Ctrl-C, or SIGTERM (stop_on_sigterm)
        log.info("stopped: %s", stop_reason(stopped))
    else:
        log.info("stopped: %s", stop_reason(None))
    return 0
