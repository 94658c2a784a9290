"""Long-lived Link streams: the PyTorch-shaped loop's data path, one stream per pair of parties.

A new gRPC call costs several times the CPU of a message on an open stream (`python -m
bench.rpc_overhead`, docs/performance.md), so the loop opens no call per step: its items travel on
streams that live as long as the deployment.

Both ends of a Link send `LinkMessage` items in order. An item with a tensor carries its first chunk
(or its shared segment); further chunks follow in messages that hold only `tensor`, and one item's
chunks are never interleaved with another's (one writer at a time).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpc
import torch

from shardtrain import carrier, errors, metrics, wire
from shardtrain.codec import Frame
from shardtrain.rpc import status_message, translate
from shardtrain.v1 import shard_pb2, tensor_pb2

log = logging.getLogger("shardtrain.link")

Item = tuple[shard_pb2.LinkMessage, "torch.Tensor | None"]
Expectation = Callable[[shard_pb2.LinkMessage, tensor_pb2.TensorHeader], None]  # (the item, its tensor's header)


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

    def __init__(self, expect: Expectation | None = None) -> None:
        self._pending: shard_pb2.LinkMessage | None = None
        self._starting: shard_pb2.LinkMessage | None = None  # the item whose tensor header comes next
        self._expect = expect
        self._tensors = wire.TensorStreamReader(expect=self._check if expect is not None else None)
        self.shared = False  # the last item's tensor came in a shared segment
        self.wire_nbytes = 0  # the last item's tensor's bytes as they travelled (fewer than its own, compressed)

    def _check(self, header: tensor_pb2.TensorHeader) -> None:
        self._expect(self._starting, header)

    def place(self, message: shard_pb2.LinkMessage, nbytes: int) -> memoryview | None:
        """Where the data of a frame about to be fed goes: straight into its item's tensor (carrier.Placer)."""
        starts = message.WhichOneof("item") is not None
        if starts and self._pending is not None or not starts and self._pending is None:
            return None  # feed() says what is wrong
        if starts:
            self._starting = message
        return self._tensors.place(message.tensor, nbytes) if message.HasField("tensor") else None

    def feed(self, frame: Frame) -> Item | None:
        """Takes one frame; returns an item once its tensor (if it has one) is complete."""
        message = frame.message
        if message.WhichOneof("item") is not None:
            if self._pending is not None:
                raise errors.DataLoss(f"link: a {message.WhichOneof('item')} item arrived before the tensor of the "
                                      f"previous {self._pending.WhichOneof('item')} item was complete")
            if not message.HasField("tensor"):
                return message, None
            self._pending = self._starting = message
            self.shared = message.tensor.HasField("shared")
            self.wire_nbytes = message.tensor.header.wire_nbytes
        elif self._pending is None:
            raise errors.InvalidArgument("link: a tensor chunk arrived outside any item")
        done = self._tensors.feed(frame)
        if done is None:
            return None
        item, self._pending = self._pending, None
        item.ClearField("tensor")
        return item, done[1]


def error_item(key: shard_pb2.StepKey | None, error: BaseException, where: str, backward: bool = False,
               optimizer_step: int = 0, through_step: int | None = None) -> shard_pb2.LinkMessage:
    """An error item for `key` (None: the whole link or an optimizer step), coded and worded as a call's status.
    A broken link's names the last step it may have cost (through_step; None: every step in flight)."""
    code, text = status_message(error, where)
    item = shard_pb2.LinkError(code=code.name, message=text, backward=backward, optimizer_step=optimizer_step)
    if key is not None:
        item.key.CopyFrom(key)
    if through_step is not None:
        item.through_step = through_step
    return shard_pb2.LinkMessage(error=item)


def raised(error: shard_pb2.LinkError) -> errors.ShardtrainError:
    """The exception an error item stands for, marked as coming from a peer."""
    exception = errors.error_for_code(error.code, error.message)
    exception.from_peer = True
    return exception


class LinkEnd:
    """One end of a Link: sends items in order, one writer at a time."""

    def __init__(self, name: str, write: Callable[[Frame], Awaitable[Any]], opening: shard_pb2.LinkOpen):
        self.name = name
        self._write = write
        self._lock = asyncio.Lock()
        self.broken: errors.ShardtrainError | None = None
        self.deployment_id = opening.deployment_id  # the link's deployment, as its open item named it
        self.expect: Expectation | None = None  # refuses an item's tensor by its header, before it is stored
        self.same_host = opening.shared_memory      # the opener can open the answering end's shared segments
        self.toward_first = True     # the other end sits before this one in the pipeline (or is the SDK's input side)
        self._carrier: carrier.Carrier | None = None

    @property
    def local(self) -> bool:
        """Whether items go on a same-host socket rather than the gRPC stream."""
        return self._carrier is not None

    def carry(self, local: carrier.Carrier) -> None:
        """Sends the items that follow on a same-host socket instead of the gRPC stream."""
        self._carrier = local
        self._write = local.write

    def close_carrier(self) -> None:
        """Closes the same-host socket, if items went on one."""
        if self._carrier is not None:
            self._carrier.close()

    async def send(self, message: shard_pb2.LinkMessage, tensor: torch.Tensor | None = None,
                   options: wire.SendOptions = wire.EXACT) -> None:
        """Sends one item; Unavailable if the link is broken."""
        await self._ready()  # first: whether items go on a socket is known once the opener took it or declined
        items = list(frames(message, tensor, options))
        async with self._lock:
            if self.broken is not None:
                raise self.broken
            try:
                for frame in items:
                    await self._write(frame)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError, ConnectionError) as error:
                self.broken = await self._why_broken(error)
                raise self.broken from None
        first = items[0].message.tensor
        _count("sent", message, first.header.wire_nbytes if tensor is not None else 0, first.HasField("shared"),
               self.local)

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
    When the answer offers a same-host socket (shardtrain.carrier), items go both ways on it instead.
    `on_item` runs on a reading task and must not block (it starts tasks or fills mailboxes);
    `on_broken` hears once why the link ended, unless close() ended it. `first_items` (items without a tensor)
    go right after the peer accepted the link, before any item send() is given.
    """

    def __init__(self, peer, opening: shard_pb2.LinkOpen, on_item: Callable[[LinkEnd, shard_pb2.LinkMessage,
                 torch.Tensor | None], None], on_broken: Callable[[ClientLink, errors.ShardtrainError], None],
                 first_items: Sequence[shard_pb2.LinkMessage] = ()):
        self.peer = peer
        self._first_items = list(first_items)
        self._call = peer.stub.Link(metadata=peer.metadata, wait_for_ready=False)
        super().__init__(peer.name, self._call.write, opening)
        self._closing = False
        self._counted = False  # counted among the open links (metrics)
        self._on_item, self._on_broken = on_item, on_broken
        self._accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self._opening = asyncio.ensure_future(self._open(opening))
        self._reader = asyncio.ensure_future(self._guarded(self._read()))
        self._carried: asyncio.Future | None = None

    async def _open(self, opening: shard_pb2.LinkOpen) -> None:
        try:
            await self._call.write(Frame(shard_pb2.LinkMessage(open=opening)))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass  # the reader hears why, from the call's status

    async def _ready(self) -> None:
        await asyncio.shield(self._accepted)

    @property
    def accepted(self) -> bool:
        """Whether the peer accepted the link (it may have broken since)."""
        return self._accepted.done() and not self._accepted.cancelled() and self._accepted.exception() is None

    async def _read(self) -> None:
        first = await self._call.read()
        if first is not grpc.aio.EOF:
            if not first.message.HasField("open"):
                raise errors.InvalidArgument(f"{self.name} did not answer the link's open item")
            if first.message.open.local_address:
                await self._take_carrier(first.message.open)
            for item in self._first_items:
                await self._write(Frame(item))
            self._accepted.set_result(None)
            self._counted = True
            metrics.link_opened(1)
            await _deliver(self._stream_frames(), self, self._on_item)
        status = await self._call.code()
        if status != grpc.StatusCode.OK:
            raise errors.error_for_code(status.name, f"{self.name}: {await self._call.details()}")
        raise errors.Unavailable(f"{self.name} closed the link")

    async def _stream_frames(self) -> AsyncIterator[Frame]:
        while (frame := await self._call.read()) is not grpc.aio.EOF:
            yield frame

    async def _take_carrier(self, answer: shard_pb2.LinkOpen) -> None:
        """Moves the items to the offered socket, or tells the peer they stay on the stream."""
        try:
            local = await carrier.connect(answer.local_address, answer.local_token, self.peer.tls,
                                          self.peer.tls_server_name)
        except (OSError, TimeoutError) as error:
            log.info("%s: no local link (%r); items stay on the gRPC stream", self.name, error)
            await self._call.write(Frame(shard_pb2.LinkMessage(open=shard_pb2.LinkOpen(local_carrier=False))))
            return
        self.carry(local)
        self._carried = asyncio.ensure_future(self._guarded(self._read_carrier(local)))

    async def _read_carrier(self, local: carrier.Carrier) -> None:
        await _deliver_carried(local, self, self._on_item)
        raise errors.Unavailable(f"{self.name} is unavailable: its local link closed")

    async def _guarded(self, reading: Awaitable[None]) -> None:
        """Runs a reading loop; whatever ends it, the owner hears of it."""
        try:
            await reading
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
        if self._counted:  # open from its acceptance to the first end heard of
            self._counted = False
            metrics.link_opened(-1)
        if not self._accepted.done():
            self._accepted.set_exception(error)
            self._accepted.exception()  # retrieved: maybe nobody was about to send
        if not self._closing:
            self._closing = True  # heard once, whichever reader saw the end first
            self._on_broken(self, error)

    async def close(self) -> None:
        """Ends the link; the peer sees the stream finish."""
        self._closing = True
        self._broke(errors.Unavailable(f"{self.name}: the link was closed"))
        self._call.cancel()
        for task in (self._reader, self._opening, self._carried):
            if task is not None:
                task.cancel()
        self.close_carrier()


class _AnsweringEnd(LinkEnd):
    """The answering end of a Link: its items wait until the opener took up or declined an offered socket."""

    def __init__(self, name: str, write: Callable[[Frame], Awaitable[Any]], opening: shard_pb2.LinkOpen):
        super().__init__(name, write, opening)
        self.decided: asyncio.Future = asyncio.get_running_loop().create_future()

    async def _ready(self) -> None:
        await asyncio.shield(self.decided)


async def serve(requests, context, name: str, on_open: Callable[[shard_pb2.LinkOpen, LinkEnd], None],
                on_item: Callable[[LinkEnd, shard_pb2.LinkMessage, torch.Tensor | None], None],
                on_closed: Callable[[LinkEnd], None], listener: carrier.Listener | None = None) -> None:
    """The answering end: checks the opening item, then hands each item to `on_item` until the opener ends.

    With a `listener`, an opener that asks for it gets a same-host socket to carry the items.
    `on_closed(end)` hears when the link is over, closed by the opener or broken alike: a grpc.aio server sees the
    stream of a client that was killed end just as one the client finished (the handler is cancelled a moment
    later, or not), so the two cannot be told apart reliably here.
    An exception from on_open or on_item ends the call with its status.
    """
    requests = requests.__aiter__()
    first = await anext(requests, None)
    if first is None or not first.message.HasField("open"):
        raise errors.InvalidArgument("a Link must start with an open item (LinkOpen)")
    end = _AnsweringEnd(name, context.write, first.message.open)
    on_open(first.message.open, end)
    answer, offer = await _answer(first.message.open, end, listener)
    await context.write(Frame(shard_pb2.LinkMessage(open=answer)))  # accepted: items may come
    readers = {asyncio.ensure_future(_read_stream(requests, end, on_item))}
    if offer is not None:
        readers.add(asyncio.ensure_future(_read_carrier(offer, end, on_item)))
    metrics.link_opened(1)
    try:
        await _until_closed(readers)
    finally:
        metrics.link_opened(-1)
        for reader in readers:
            reader.cancel()
        if offer is not None:
            listener.withdraw(answer.local_token)
        end.close_carrier()
        end.broken = errors.Unavailable(f"{name}: the link was closed")
        if not end.decided.done():
            end.decided.set_result(None)  # a sender waiting for the opener's choice finds the link broken
        on_closed(end)


async def _answer(opening: shard_pb2.LinkOpen, end: _AnsweringEnd,
                  listener: carrier.Listener | None) -> tuple[shard_pb2.LinkOpen, asyncio.Future | None]:
    """The open item to echo, offering a same-host socket when the opener asked and this end has a listener;
    with the future of the socket's Carrier (None: no offer, items stay on the stream)."""
    answer = shard_pb2.LinkOpen()
    answer.CopyFrom(opening)
    try:
        if (opening.local_carrier or opening.tcp_carrier) and listener is not None:
            answer.local_address, token, offer = await listener.offer(same_host=opening.local_carrier)
            answer.local_token, answer.local_carrier = token, True
            return answer, offer
    except OSError:
        pass  # the listener logged why, once
    answer.local_carrier = False
    end.decided.set_result(None)
    return answer, None


async def _until_closed(readers: set[asyncio.Future]) -> None:
    """Waits until one of the link's readers ended it (raising what ended that reader)."""
    while readers:
        done, readers = await asyncio.wait(readers, return_when=asyncio.FIRST_COMPLETED)
        for reader in done:
            if reader.result() != "declined":  # raises what ended the reader
                return


async def _read_stream(requests, end: _AnsweringEnd, on_item) -> str:
    """Reads items from the gRPC stream until the opener finishes it."""
    await _deliver(_declines_taken(requests, end), end, on_item)
    return "ended"


async def _declines_taken(requests, end: _AnsweringEnd) -> AsyncIterator[Frame]:
    """The stream's frames, less a second open item: that one declines the offered socket."""
    async for frame in requests:
        if frame.message.HasField("open") and not end.decided.done():
            end.decided.set_result(None)
        else:
            yield frame


async def _read_carrier(offer: asyncio.Future, end: _AnsweringEnd, on_item) -> str:
    """Reads items from the offered socket once the opener connected to it."""
    await asyncio.wait((offer, end.decided), timeout=carrier.CONNECT_SECONDS, return_when=asyncio.FIRST_COMPLETED)
    if not offer.done():
        if end.decided.done():
            return "declined"
        raise errors.Unavailable(f"{end.name}: the opener neither took the offered local link nor declined it "
                                 f"within {carrier.CONNECT_SECONDS:g} s")
    local = offer.result()
    end.carry(local)
    end.decided.set_result(None)
    await _deliver_carried(local, end, on_item)
    return "ended"


def _count(direction: str, message: shard_pb2.LinkMessage, nbytes: int, shared: bool, socket: bool) -> None:
    """Records one item sent or received, by its kind, the path its tensor took and the bytes that travelled
    (when metrics are on)."""
    if not metrics.enabled():
        return
    path = "shared_memory" if shared else "socket" if socket else "grpc"
    metrics.moved(direction, message.WhichOneof("item") or "", path, nbytes)


async def _deliver(frames: AsyncIterator[Frame], end: LinkEnd, on_item) -> None:
    """Hands each item to `on_item` as its last frame arrives, until `frames` (a stream's or a socket's) ends."""
    items = ItemReader(end.expect)
    async for frame in frames:
        item = items.feed(frame)
        if item is not None:
            _count("received", item[0], items.wire_nbytes if item[1] is not None else 0, items.shared, False)
            on_item(end, *item)


async def _deliver_carried(local: carrier.Carrier, end: LinkEnd, on_item) -> None:
    """Like _deliver, for a same-host socket: each item goes to `on_item` from the socket's read callback."""
    items = ItemReader(end.expect)

    def on_frame(frame: Frame) -> None:
        item = items.feed(frame)
        if item is not None:
            _count("received", item[0], items.wire_nbytes if item[1] is not None else 0, items.shared, True)
            on_item(end, *item)
    await local.deliver(on_frame, items.place)
