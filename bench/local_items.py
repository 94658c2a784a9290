"""A tensor item on a same-host Link: its bytes inside the frame, or in a shared-memory segment.

    python -m bench.local_items [--sizes 16K 64K 256K 1M 4M 16M] [--exchanges 400] [--rounds 3]

Two processes joined by a Unix socket (shardtrain.carrier, what a same-host Link uses) play
ping-pong with one forward item carrying a float32 tensor, built and read by the Link's own code
(link.frames, link.ItemReader): the echo sends the tensor it received straight back, as a stage
sends on what it computed. Each size is timed both ways, in turns: "inline" (the bytes follow the
message in the frame, CRC-checked on arrival) and "segment" (copied into one of the sender's
segments, which the receiver maps; shardtrain.shm). It prints the median round trip and the CPU of
both processes per round trip, and the segment's ratio to inline; below 1.0x the segment wins.

Below shm.MIN_BYTES (64 KiB) both ways send inline, which the table shows as a ratio near 1.0x.
One run on the 2-core development machine (`--exchanges 300 --rounds 3`), segment against inline:
64 KiB 0.83x the round trip (427 against 514 us) and 0.81x the CPU, 256 KiB 0.46x, 1 MiB 0.23x,
16 MiB 0.18x. So a Link on a local socket keeps shm.MIN_BYTES, the gRPC stream's crossover, as its
own: an inline 64 KiB item costs a CRC-32 on each side (about 15 us each) and two copies through
the socket, more than a segment's bookkeeping.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from bench.rpc_overhead import _cpu_seconds  # noqa: E402
from bench.transport import _size, parse_size  # noqa: E402
from client_sdk.processes import reap  # noqa: E402
from shardtrain import carrier, link_streams, shm, wire  # noqa: E402
from shardtrain.v1 import shard_pb2  # noqa: E402

WAYS = ("inline", "segment")


def _options(way: str, pool: shm.SegmentPool) -> wire.SendOptions:
    return wire.SendOptions(segments=pool if way == "segment" else None)


async def _items(local: carrier.Carrier):
    """The Link items that arrive on `local`, one at a time."""
    reader = link_streams.ItemReader()
    while (frame := await local.read()) is not None:
        item = reader.feed(frame)
        if item is not None:
            yield item


async def _echo(fd: int) -> None:
    """Sends each tensor back the way it came (the way is the message's step number: 0 inline, 1 segment)."""
    local = await carrier.over(socket.socket(fileno=fd))
    pool = shm.SegmentPool()
    try:
        async for message, tensor in _items(local):
            for frame in link_streams.frames(message, tensor, _options(WAYS[message.forward.key.step], pool)):
                await local.write(frame)
    finally:
        pool.close()
        local.close()


def _echo_main(fd: int) -> None:
    torch.set_num_threads(1)
    asyncio.run(_echo(fd))


async def _measure(fd: int, echo_pid: int, sizes: list[int], exchanges: int,
                   rounds: int) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """Per (size, way): (median round trip, CPU of both sides per round trip) of each round."""
    local = await carrier.over(socket.socket(fileno=fd))
    pool = shm.SegmentPool()
    items = _items(local).__aiter__()
    results: dict[tuple[int, str], list[tuple[float, float]]] = {}
    try:
        for round_ in range(rounds):
            for size in sizes:
                tensor = torch.rand(size // 4)
                for way in WAYS if round_ % 2 == 0 else reversed(WAYS):
                    message = shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader(
                        key=shard_pb2.StepKey(step=WAYS.index(way))))
                    options = _options(way, pool)
                    times = []
                    cpu = _cpu_seconds(os.getpid()) + _cpu_seconds(echo_pid)
                    for _ in range(exchanges):
                        start = time.perf_counter()
                        for frame in link_streams.frames(message, tensor, options):
                            await local.write(frame)
                        _, back = await anext(items)
                        times.append(time.perf_counter() - start)
                        if len(times) == 1 and not torch.equal(back, tensor):
                            raise RuntimeError(f"the {way} echo of {_size(size)} came back different")
                        del back  # hands a segment back before the next send, as a stage's finished step does
                    cpu = _cpu_seconds(os.getpid()) + _cpu_seconds(echo_pid) - cpu
                    results.setdefault((size, way), []).append((statistics.median(times), cpu / exchanges))
    finally:
        pool.close()
        local.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["16K", "64K", "256K", "1M", "4M", "16M"])
    parser.add_argument("--exchanges", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--echo", type=int, help=argparse.SUPPRESS)  # the echo process, on an inherited socket
    args = parser.parse_args()
    if args.echo is not None:
        _echo_main(args.echo)
        return
    sizes = [parse_size(size) for size in args.sizes]
    torch.set_num_threads(1)
    mine, theirs = socket.socketpair(socket.AF_UNIX)
    echo = subprocess.Popen([sys.executable, "-m", "bench.local_items", "--echo", str(theirs.fileno())],
                            pass_fds=[theirs.fileno()], cwd=pathlib.Path(__file__).resolve().parent.parent)
    theirs.close()
    try:
        results = asyncio.run(_measure(mine.detach(), echo.pid, sizes, args.exchanges, args.rounds))
    finally:
        reap(echo, 10)  # it ends when this end of the socket closes
    print(f"{'tensor':>8} | {'inline: round trip, CPU':>24} | {'segment: round trip, CPU':>25} | segment / inline")
    for size in sizes:
        row = {}
        for way in WAYS:
            rounds = results[(size, way)]
            row[way] = (statistics.median(t for t, _ in rounds), statistics.median(c for _, c in rounds))
        print(row_text(size, row["inline"], row["segment"]))


def row_text(size: int, inline: tuple[float, float], shared: tuple[float, float]) -> str:
    """One size's row: each way's (round trip, CPU per round trip) in seconds, and the segment's ratios to inline.
    The CPU is read from /proc in clock ticks (10 ms), so a short run can count none; its ratio is then "n/a"."""
    def ratio(part: float, whole: float) -> str:
        return f"{part / whole:.2f}x" if whole > 0 else "n/a"
    return (f"{_size(size):>8} | {inline[0] * 1e6:9.0f} us, {inline[1] * 1e6:7.0f} us CPU | "
            f"{shared[0] * 1e6:9.0f} us, {shared[1] * 1e6:7.0f} us CPU | "
            f"{ratio(shared[0], inline[0])} time, {ratio(shared[1], inline[1])} CPU")


if __name__ == "__main__":
    main()
