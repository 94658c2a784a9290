"""A ShardService that serves only FetchTensor and breaks its first stream halfway: for the resume test.

Run as a script; prints {"port": N} when serving, then one line per FetchTensor with the offset asked for.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import torch

from shardtrain import rpc, wire
from shardtrain.settings import Security

TENSOR = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
CHUNK_BYTES = 64 << 10
BREAK_AFTER = 5  # frames of the first stream


class FlakyFetch:
    """Streams TENSOR from the offset asked for; the first stream is cut after BREAK_AFTER frames."""

    def __init__(self):
        self.calls = 0

    async def FetchTensor(self, request, context):
        self.calls += 1
        print(json.dumps({"offset": request.offset}), flush=True)
        frames = wire.tensor_frames(TENSOR, request.name, wire.SendOptions(CHUNK_BYTES), start=request.offset)
        for index, frame in enumerate(frames):
            if self.calls == 1 and index == BREAK_AFTER:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection dropped (injected)")
            yield frame


async def serve() -> None:
    server = rpc.new_server(Security())
    rpc.add_service(server, FlakyFetch(), rpc.SHARD_SERVICE)
    port = rpc.bind(server, "127.0.0.1:0", Security())
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve())
