"""What counting and timing every request (shardtrain.request_metrics, on with --metrics-port) costs a small call.

    python -m bench.request_metrics [--exchanges 2000] [--rounds 6] [--size 100] [--no-token]

Two echo servers, each a process of its own and built as a service builds its server (rpc.new_server, with the
token check every service that listens beyond loopback has, unless --no-token): one with metrics off, one with
them on, so that its server counts and times every call. The echo answers as ShardService's Describe (unary)
and Forward (client-streaming), so that the token check lets the client's calls through. The client times, in
alternating rounds (the order reversed every other round), a unary call and a client-streaming call of one
message against each, and prints the median round trip of each, and the ratios (with metrics / without) of the
round trip and of the server's CPU per call: the median of the rounds and their range.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import statistics

import grpc

from bench.rpc_overhead import _one_message, _same, _timed
from shardtrain import metrics, rpc
from shardtrain.settings import Security

SERVICE = "shardtrain.v1.ShardService"


async def _serve(ports, counted: bool, token: str) -> None:
    async def unary(request, context):
        return request

    async def client_stream(requests, context):
        async for request in requests:
            return request

    if counted:
        metrics.serve("127.0.0.1", 0, "shard")  # before the server, as a service does
    handlers = {"Describe": grpc.unary_unary_rpc_method_handler(unary, _same, _same),
                "Forward": grpc.stream_unary_rpc_method_handler(client_stream, _same, _same)}
    server = rpc.new_server(Security(token=token))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def _server_main(ports, counted: bool, token: str) -> None:
    asyncio.run(_serve(ports, counted, token))


async def _round(channels: dict, pids: dict, payload: bytes, exchanges: int, order: list[str],
                 token: str) -> dict:
    """{(way, server): (median seconds, server CPU per call)} of one round."""
    results, metadata = {}, Security(token=token).metadata
    for name in order:
        unary = channels[name].unary_unary(f"/{SERVICE}/Describe", _same, _same)
        stream = channels[name].stream_unary(f"/{SERVICE}/Forward", _same, _same)
        for way, call in (("unary call", lambda: unary(payload, metadata=metadata)),
                          ("client-streaming call", lambda: stream(_one_message(payload), metadata=metadata))):
            seconds, _, server_cpu = await _timed(call, exchanges, pids[name])
            results[way, name] = (seconds, server_cpu)
    return results


async def _run(ports: dict, pids: dict, args) -> None:
    channels = {name: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for name, port in ports.items()}
    payload = b"x" * args.size
    token = "" if args.no_token else "bench"
    await _round(channels, pids, payload, 200, list(ports), token)  # warm both
    rounds = []
    for index in range(args.rounds):
        order = list(ports) if index % 2 == 0 else list(reversed(ports))
        rounds.append(await _round(channels, pids, payload, args.exchanges, order, token))
    print(f"payload {args.size} bytes, {args.exchanges} calls x {args.rounds} rounds, "
          f"{'no token' if args.no_token else 'token checked'} (with metrics / without):")
    for way in ("unary call", "client-streaming call"):
        latency = [r[way, "with"][0] / r[way, "without"][0] for r in rounds]
        # CPU is read in clock ticks: a short round may show none (nan, not a ratio)
        cpu = [r[way, "with"][1] / r[way, "without"][1] if r[way, "without"][1] else math.nan for r in rounds]
        without = statistics.median(r[way, "without"][0] for r in rounds)
        with_metrics = statistics.median(r[way, "with"][0] for r in rounds)
        print(f"  {way:22s} median round trip {without * 1e6:6.1f} us without, {with_metrics * 1e6:6.1f} us with: "
              f"latency x{statistics.median(latency):.3f} (rounds {min(latency):.3f}-{max(latency):.3f}), "
              f"server CPU x{statistics.median(cpu):.3f} (rounds {min(cpu):.3f}-{max(cpu):.3f})")
    for channel in channels.values():
        await channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exchanges", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--no-token", action="store_true", help="servers without the token check")
    args = parser.parse_args()
    servers, ports = {}, {}
    try:
        for name in ("without", "with"):
            queue = multiprocessing.Queue()
            servers[name] = multiprocessing.Process(target=_server_main, daemon=True,
                                                    args=(queue, name == "with", "" if args.no_token else "bench"))
            servers[name].start()
            ports[name] = queue.get(timeout=30)
        asyncio.run(_run(ports, {name: server.pid for name, server in servers.items()}, args))
    finally:
        for server in servers.values():
            server.kill()
            server.join()


if __name__ == "__main__":
    main()
