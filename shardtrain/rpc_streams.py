"""Streams of a header on the first message and tensor chunks after, as their receiver reads them: a client
stream on a shard (LoadState, Forward...), a server stream in the SDK (ReadOptimizerState)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import torch

from shardtrain import wire
from shardtrain.codec import Frame
from shardtrain.errors import DeadlineExceeded, InvalidArgument
from shardtrain.v1.tensor_pb2 import TensorHeader


class RequestReader:
    """Reads a stream of Frames: a header on the first message, and any message may carry a tensor chunk.

    With `idle`, a stream that sends nothing for that many seconds ends with DeadlineExceeded: a client that
    opened a stream and went quiet would otherwise hold the call, and what it sent so far, for good.
    """

    def __init__(self, requests: AsyncIterator, idle: float | None = None):
        self._requests = requests.__aiter__()
        self._first = None
        self._idle = idle

    async def _next(self):
        """The stream's next message, or None at its end."""
        try:
            async with asyncio.timeout(self._idle):  # a timer, not a task per message as wait_for would make
                return await anext(self._requests, None)
        except TimeoutError:
            raise DeadlineExceeded(f"the stream sent nothing for {self._idle:g} s") from None

    async def header(self):
        """The first message's header; InvalidArgument if the stream does not start with one."""
        self._first = await self._next()
        if self._first is None or not self._first.message.HasField("header"):
            raise InvalidArgument("stream must start with a header message")
        return self._first.message.header

    async def tensors(self, count: int = 0, expect: Callable[[TensorHeader], None] | None = None
                      ) -> dict[str, torch.Tensor]:
        """Every tensor in the stream by name, or the first `count` as soon as they are complete; `expect` refuses
        a tensor by its header, before any of its bytes are stored."""
        return await wire.collect(self._chunks(), wire.TensorStreamReader(expect=expect), count=count)

    def each_tensor(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Each tensor of the stream, (name, tensor), as soon as its last byte has arrived."""
        return wire.each_tensor(self._chunks())

    async def _chunks(self) -> AsyncIterator[Frame]:
        yield self._first
        while (frame := await self._next()) is not None:
            if frame.message.HasField("header"):
                raise InvalidArgument("only the first message of a stream may carry a header")
            yield frame
