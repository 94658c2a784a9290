"""Long-lived Link streams: the PyTorch-shaped loop's data path, one stream per pair of parties.

A new gRPC call costs far more than a message on an open stream. `python -m bench.rpc_overhead`
(two grpc.aio processes on the 2-core development machine, 2000 exchanges, one run): a
client-streaming call of one message, as Forward is, took 888 us and 1.36 ms of CPU (both sides
together) for 100 bytes; a ping-pong on an open bidirectional stream 321 us and 0.45 ms; a message
streamed on it 0.34 ms of CPU. For 64 KiB: 939 us / 1.32 ms against 424 us / 0.53 ms. A training
step of the seed's 3-stage model made about nine calls; over Links it sends 13 messages and opens
nothing.

Both ends of a Link send `LinkMessage` items in order. An item with a tensor carries its first chunk
(or its shared segment); further chunks follow in messages that hold only `tensor`, and one item's
chunks are never interleaved with another's (one writer at a time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
import torch

from shardtrain import errors, wire
from shardtrain.codec import Frame
from shardtrain.rpc import status_message, translate
from shardtrain.v1 import shard_pb2


Item = tuple[shard_pb2.LinkMessage, "torch.Tensor | None"]


def frames(message: shard_pb2.LinkMessage, tensor: torch.Tensor | None = None,
           options: wire.SendOptions = wire.EXACT) -> Iterator[Frame]:
    """The Frames of one item: the message alone, or the message with its tensor's first chunk, then the rest."""
    if tensor is None:
        yield Frame(message)
        return
    first = [True]

    def wrap(chunk):
        if first[0]:
            first[0] = False
            wrapped = shard_pb2.LinkMessage()
            wrapped.CopyFrom(message)
            wrapped.tensor.CopyFrom(chunk)
            return wrapped
        return shard_pb2.LinkMessage(tensor=chunk)
    yield from wire.tensor_frames(tensor, "", options, wrap)


class ItemReader:
    """Turns the Frames of a Link into items, (message, tensor or None), each once it is complete."""

    def __init__(self) -> None:
        self._pending: shard_pb2.LinkMessage | None = None
        self._tensors = wire.TensorStreamReader()

    def feed(self, frame: Frame) -> Item | None:
        """Takes one frame; returns an item once its tensor (if it has one) is complete."""
        message = frame.message
        if message.WhichOneof("item") is not None:
            if self._pending is not None:
                raise errors.DataLoss(f"link: a {message.WhichOneof('item')} item arrived before the tensor of the "
                                      f"previous {self._pending.WhichOneof('item')} item was complete")
            if not message.HasField("tensor"):
                return message, None
            self._pending = message
        elif self._pending is None:
            raise errors.InvalidArgument("link: a tensor chunk arrived outside any item")
        done = self._tensors.feed(frame)
        if done is None:
            return None
        item, self._pending = self._pending, None
        item.ClearField("tensor")
        return item, done[1]


def error_item(key: shard_pb2.StepKey | None, error: BaseException, where: str, backward: bool = False,
               optimizer_step: int = 0) -> shard_pb2.LinkMessage:
    """An error item for `key` (None: the whole link or an optimizer step), coded and worded as a call's status."""
    code, text = status_message(error, where)
    item = shard_pb2.LinkError(code=code.name, message=text, backward=backward, optimizer_step=optimizer_step)
    if key is not None:
        item.key.CopyFrom(key)
    return shard_pb2.LinkMessage(error=item)


def raised(error: shard_pb2.LinkError) -> errors.ShardtrainError:
    """The exception an error item stands for, marked as coming from a peer."""
    exception = errors.error_for_code(error.code, error.message)
    exception.from_peer = True
    return exception


class LinkEnd:
    """One end of a Link: sends items in order, one writer at a time."""

    def __init__(self, name: str, write: Callable[[Frame], Awaitable[Any]]):
        self.name = name
        self._write = write
        self._lock = asyncio.Lock()
        self.broken: errors.ShardtrainError | None = None
        self.deployment_id = ""      # what the owner knows of the other end:
        self.same_host = False       # it can open this process's shared segments,
        self.toward_first = True     # it sits before this one in the pipeline (or is the SDK's input side)

    async def send(self, message: shard_pb2.LinkMessage, tensor: torch.Tensor | None = None,
                   options: wire.SendOptions = wire.EXACT) -> None:
        """Sends one item; Unavailable if the link is broken."""
        items = list(frames(message, tensor, options))
        await self._ready()
        async with self._lock:
            if self.broken is not None:
                raise self.broken
            try:
                for frame in items:
                    await self._write(frame)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as error:
                self.broken = await self._why_broken(error)
                raise self.broken from None

    async def _ready(self) -> None:
        """Returns once items may be sent (at once for the answering end)."""

    async def _why_broken(self, error: Exception) -> errors.ShardtrainError:
        """The error a failed write stands for."""
        broken = errors.Unavailable(f"{self.name} is unavailable: the link broke ({error})")
        broken.from_peer = True
        return broken


class ClientLink(LinkEnd):
    """The opener's end: a Link call to `peer`, whose incoming items go to `on_item` as they complete.

    The open item goes at once; the peer answers it with its own open item once it accepted the link,
    and no other item is sent before. A refused link then ends with the peer's status (FAILED_PRECONDITION:
    another deployment) instead of failing a write halfway, which gRPC reports as an internal error.
    `on_item` runs on the reading task and must not block (it starts tasks or fills mailboxes);
    `on_broken` hears once why the link ended, unless close() ended it.
    """

    def __init__(self, peer, opening: shard_pb2.LinkOpen, on_item: Callable[[LinkEnd, shard_pb2.LinkMessage,
                 torch.Tensor | None], None], on_broken: Callable[[ClientLink, errors.ShardtrainError], None]):
        self.peer = peer
        self._call = peer.stub.Link(metadata=peer.metadata, wait_for_ready=False)
        super().__init__(peer.name, self._call.write)
        self._closing = False
        self._on_item, self._on_broken = on_item, on_broken
        self._accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self._opening = asyncio.ensure_future(self._open(opening))
        self._reader = asyncio.ensure_future(self._read())

    async def _open(self, opening: shard_pb2.LinkOpen) -> None:
        try:
            await self._write(Frame(shard_pb2.LinkMessage(open=opening)))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass  # the reader hears why, from the call's status

    async def _ready(self) -> None:
        await asyncio.shield(self._accepted)

    async def _read(self) -> None:
        items = ItemReader()
        try:
            first = await self._call.read()
            if first is not grpc.aio.EOF:
                if not first.message.HasField("open"):
                    raise errors.InvalidArgument(f"{self.name} did not answer the link's open item")
                self._accepted.set_result(None)
            while first is not grpc.aio.EOF:
                frame = await self._call.read()
                if frame is grpc.aio.EOF:
                    break
                item = items.feed(frame)
                if item is not None:
                    self._on_item(self, *item)
            status = await self._call.code()
            if status != grpc.StatusCode.OK:
                raise errors.error_for_code(status.name, f"{self.name}: {await self._call.details()}")
            raise errors.Unavailable(f"{self.name} closed the link")
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as error:
            self._broke(translate(error, self.name))
        except Exception as error:  # noqa: BLE001 - whatever ended the link, the owner hears of it
            self._broke(error if isinstance(error, errors.ShardtrainError) else
                        errors.InternalError(f"{self.name}: link failed: {error!r}"))

    async def _why_broken(self, error: Exception) -> errors.ShardtrainError:
        """A write fails when the call has ended: the peer's status says why (a refused open, a dead peer)."""
        try:
            status = await asyncio.wait_for(self._call.code(), 5.0)
            details = await self._call.details()
        except (TimeoutError, asyncio.CancelledError, grpc.aio.AioRpcError):
            return await super()._why_broken(error)
        if status in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
            return await super()._why_broken(details or error)
        broken = errors.error_for_code(status.name, details or f"{self.name}: {status.name}")
        broken.from_peer = True
        return broken

    def _broke(self, error: errors.ShardtrainError) -> None:
        if self.broken is None:
            self.broken = error
        if not self._accepted.done():
            self._accepted.set_exception(error)
            self._accepted.exception()  # retrieved: maybe nobody was about to send
        if not self._closing:
            self._on_broken(self, error)

    async def close(self) -> None:
        """Ends the link; the peer sees the stream finish."""
        self._closing = True
        self._broke(errors.Unavailable(f"{self.name}: the link was closed"))
        self._call.cancel()
        self._reader.cancel()
        self._opening.cancel()


async def serve(requests, context, name: str, on_open: Callable[[shard_pb2.LinkOpen, LinkEnd], None],
                on_item: Callable[[LinkEnd, shard_pb2.LinkMessage, torch.Tensor | None], None],
                on_closed: Callable[[LinkEnd, bool], None]) -> None:
    """The answering end: checks the opening item, then hands each item to `on_item` until the opener ends.

    `on_closed(end, broke)` hears when the stream is over: broke is False when the opener finished it.
    An exception from on_open or on_item ends the call with its status.
    """
    requests = requests.__aiter__()
    first = await anext(requests, None)
    if first is None or not first.message.HasField("open"):
        raise errors.InvalidArgument("a Link must start with an open item (LinkOpen)")
    end = LinkEnd(name, context.write)
    on_open(first.message.open, end)
    await context.write(Frame(shard_pb2.LinkMessage(open=first.message.open)))  # accepted: items may come
    broke = True
    try:
        items = ItemReader()
        async for frame in requests:
            item = items.feed(frame)
            if item is not None:
                on_item(end, *item)
        broke = False
    finally:
        end.broken = errors.Unavailable(f"{name}: the link was closed")
        on_closed(end, broke)
