"""What one exchange costs in grpc.aio: a new call against a message on a stream that is already open.

    python -m bench.rpc_overhead [--exchanges 2000] [--sizes 100 65536] [--rounds 2]

A server process echoes what it gets. For each payload size, the client times, in turns:
a unary call, a client-streaming call of one message (what Forward, Backward and
AccumulateGradient are), a ping-pong on one open bidirectional stream (what a Link is), and
messages streamed on it without waiting. It prints the median round trip and the CPU each side
spent per exchange, and the ratios of the calls to the open stream. shardtrain.link cites these.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time

import grpc


def _same(payload: bytes) -> bytes:
    return payload


async def _serve(ports) -> None:
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
    await server.start()
    await server.wait_for_termination()


def _server_main(ports) -> None:
    asyncio.run(_serve(ports))


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one_message(payload: bytes):
    yield payload


async def _measure(channel, server_pid: int, way: str, payload: bytes, exchanges: int) -> tuple[float, float, float]:
    """(median seconds per exchange, client CPU per exchange, server CPU per exchange)."""
    unary = channel.unary_unary("/bench.Echo/Unary", _same, _same)
    client_stream = channel.stream_unary("/bench.Echo/ClientStream", _same, _same)
    stream = channel.stream_stream("/bench.Echo/Link", _same, _same)() if way.startswith("open stream") else None
    times = []
    cpu = (_cpu_seconds(os.getpid()), _cpu_seconds(server_pid))
    started = time.perf_counter()
    if way == "open stream, streamed":
        async def read_all() -> None:
            for _ in range(exchanges):
                await stream.read()
        reader = asyncio.ensure_future(read_all())
        for _ in range(exchanges):
            await stream.write(payload)
        await reader
        times = [(time.perf_counter() - started) / exchanges]
    else:
        for _ in range(exchanges):
            start = time.perf_counter()
            if way == "unary call":
                await unary(payload)
            elif way == "client-streaming call":
                await client_stream(_one_message(payload))
            else:
                await stream.write(payload)
                await stream.read()
            times.append(time.perf_counter() - start)
    client, server = _cpu_seconds(os.getpid()) - cpu[0], _cpu_seconds(server_pid) - cpu[1]
    if stream is not None:
        await stream.done_writing()
    return statistics.median(times), client / exchanges, server / exchanges


WAYS = ("unary call", "client-streaming call", "open stream, ping-pong", "open stream, streamed")


async def _run(port: int, server_pid: int, args) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await _measure(channel, server_pid, "unary call", b"warm", 200)
        for size in args.sizes:
            payload = b"x" * size
            results: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
            for _ in range(args.rounds):
                for way in WAYS:
                    results[way].append(await _measure(channel, server_pid, way, payload, args.exchanges))
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
    server = multiprocessing.Process(target=_server_main, args=(ports,), daemon=True)
    server.start()
    try:
        asyncio.run(_run(ports.get(timeout=30), server.pid, args))
    finally:
        server.kill()
        server.join()


if __name__ == "__main__":
    main()
