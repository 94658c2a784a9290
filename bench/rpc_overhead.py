"""What one exchange costs in grpc.aio: a new call against a message on a stream that is already open.

    python -m bench.rpc_overhead [--exchanges 2000] [--sizes 100 65536] [--rounds 2]

A server process echoes what it gets. For each payload size, the client times, in turns:
a unary call, a client-streaming call of one message (what Forward, Backward and
AccumulateGradient are), a ping-pong on one open bidirectional stream (what a Link is),
messages streamed on it without waiting, and a ping-pong of Link frames on a Unix socket
(shardtrain.carrier, what a same-host Link uses). It prints the median round trip and the CPU each
side spent per exchange, and the ratios to the open stream. shardtrain.link_streams and carrier cite these.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

import grpc

from shardtrain import carrier
from shardtrain.codec import Frame
from shardtrain.v1 import shard_pb2, tensor_pb2


def _same(payload: bytes) -> bytes:
    return payload


async def _echo_frames(listening: socket.socket) -> None:
    """Sends each frame back on the socket it came by, one connection at a time."""
    loop = asyncio.get_running_loop()
    while True:
        accepted, _ = await loop.sock_accept(listening)
        local = await carrier.over(accepted)
        while (frame := await local.read()) is not None:
            await local.write(frame)
        local.close()


async def _serve(ports, socket_path: str) -> None:
    async def unary(request, context):
        return request

    async def client_stream(requests, context):
        async for request in requests:
            return request

    async def link(requests, context):
        async for request in requests:
            await context.write(request)

    handlers = {"Unary": grpc.unary_unary_rpc_method_handler(unary, _same, _same),
                "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream, _same, _same),
                "Link": grpc.stream_stream_rpc_method_handler(link, _same, _same)}
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(socket_path)
    listening.listen()
    listening.setblocking(False)
    echo = asyncio.ensure_future(_echo_frames(listening))  # noqa: F841 - serves until the process ends
    await server.start()
    await server.wait_for_termination()


def _server_main(ports, socket_path: str) -> None:
    asyncio.run(_serve(ports, socket_path))


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one_message(payload: bytes):
    yield payload


async def _timed(exchange: Callable[[], Awaitable[None]], exchanges: int,
                 server_pid: int) -> tuple[float, float, float]:
    """(median seconds per exchange, client CPU per exchange, server CPU per exchange) of `exchanges` awaits."""
    times = []
    cpu = (_cpu_seconds(os.getpid()), _cpu_seconds(server_pid))
    for _ in range(exchanges):
        start = time.perf_counter()
        await exchange()
        times.append(time.perf_counter() - start)
    client, server = _cpu_seconds(os.getpid()) - cpu[0], _cpu_seconds(server_pid) - cpu[1]
    return statistics.median(times), client / exchanges, server / exchanges


async def _stream_all(stream, payload: bytes, messages: int) -> None:
    """Writes `messages` payloads without waiting for answers, while reading the echoes."""
    async def read_all() -> None:
        for _ in range(messages):
            await stream.read()
    reader = asyncio.ensure_future(read_all())
    for _ in range(messages):
        await stream.write(payload)
    await reader


async def _measure(channel, server_pid: int, way: str, payload: bytes, exchanges: int,
                   socket_path: str = "") -> tuple[float, float, float]:
    """(median seconds per exchange, client CPU per exchange, server CPU per exchange)."""
    if way == "local socket, ping-pong":
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(socket_path)
        local = await carrier.over(sock)
        frame = Frame(shard_pb2.LinkMessage(tensor=tensor_pb2.TensorChunk()), payload)

        async def round_trip() -> None:
            await local.write(frame)
            await local.read()
        try:
            return await _timed(round_trip, exchanges, server_pid)
        finally:
            local.close()
    if way.startswith("open stream"):
        stream = channel.stream_stream("/bench.Echo/Link", _same, _same)()

        async def ping_pong() -> None:
            await stream.write(payload)
            await stream.read()
        try:
            if way == "open stream, ping-pong":
                return await _timed(ping_pong, exchanges, server_pid)
            total = await _timed(lambda: _stream_all(stream, payload, exchanges), 1, server_pid)
            return tuple(value / exchanges for value in total)
        finally:
            await stream.done_writing()
    if way == "unary call":
        unary = channel.unary_unary("/bench.Echo/Unary", _same, _same)
        return await _timed(lambda: unary(payload), exchanges, server_pid)
    client_stream = channel.stream_unary("/bench.Echo/ClientStream", _same, _same)
    return await _timed(lambda: client_stream(_one_message(payload)), exchanges, server_pid)


WAYS = ("unary call", "client-streaming call", "open stream, ping-pong", "open stream, streamed",
        "local socket, ping-pong")


async def _run(port: int, server_pid: int, socket_path: str, args) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await _measure(channel, server_pid, "unary call", b"warm", 200)
        for size in args.sizes:
            payload = b"x" * size
            results: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
            for _ in range(args.rounds):
                for way in WAYS:
                    results[way].append(await _measure(channel, server_pid, way, payload, args.exchanges,
                                                       socket_path))
            print(f"payload {size} bytes ({args.exchanges} exchanges x {args.rounds} rounds, medians of rounds):")
            medians = {way: [statistics.median(r[i] for r in runs) for i in range(3)] for way, runs in results.items()}
            ping = medians["open stream, ping-pong"]
            for way, (seconds, client, server) in medians.items():
                label = "per message" if way.endswith("streamed") else "round trip"
                print(f"  {way:24s} {label} {seconds * 1e6:7.1f} us   CPU client {client * 1e6:6.1f} us, "
                      f"server {server * 1e6:6.1f} us   CPU / ping-pong {(client + server) / (ping[1] + ping[2]):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exchanges", type=int, default=2000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 65536])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    ports = multiprocessing.Queue()
    directory = tempfile.mkdtemp(prefix="shardtrain-bench-")
    socket_path = os.path.join(directory, "echo.sock")
    server = multiprocessing.Process(target=_server_main, args=(ports, socket_path), daemon=True)
    server.start()
    try:
        asyncio.run(_run(ports.get(timeout=30), server.pid, socket_path, args))
    finally:
        server.kill()
        server.join()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
