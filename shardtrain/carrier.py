"""The same-host carrier of a Link: a Unix socket that takes the Link's items off its gRPC stream.

Why: in grpc.aio every message costs a completion-queue event, which grpc's poller thread hands to
the event loop through a socket, and every write waits for one; a ping-pong of Link frames on a Unix
socket costs about a third of the CPU of the same ping-pong on an open gRPC stream (`python -m
bench.rpc_overhead`, docs/performance.md). Same-host Links are common: a host with several GPUs runs
one shard per GPU, and every local cluster is one. TensorPipe, under torch.distributed.rpc, makes the
same choice with its shm transport.

Each end is an asyncio Protocol that cuts frames out of what a read brings and hands the items to the
link in the read callback: no task wakes per frame.

The Link's gRPC stream still opens, authenticates and ends the link: the socket is offered in the
answer to the open item, with a random token that only the (authenticated) opener learns, and it
lives in a directory only this user can enter. The opener first writes the token. Then each frame
is its length (4 bytes, little-endian), the length of its message (4 bytes), the LinkMessage's
protobuf bytes, and the data of the message's TensorChunk, if any, which the message leaves out
(its `data` field stays empty). The receiver parses the message alone, then asks its consumer where
the data goes (`place`): a chunk of a tensor being assembled is received straight into that tensor's
memory, so a byte is copied from the socket once. Other data is taken as a view of what was read.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import secrets
import shutil
import ssl
import struct
import tempfile
from collections.abc import Callable

import numpy
from google.protobuf.message import DecodeError

from shardtrain import enums, errors, shm
from shardtrain.codec import Frame
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.carrier")

_PREFIX = struct.Struct("<I")  # a frame's length, and inside the frame the length of its message
TOKEN_BYTES = 16
MAX_FRAME_BYTES = 1 << 30  # a frame holds one chunk (64 MiB at most) or a small item
_JOIN_BYTES = 1 << 16     # frames up to this size go in one send (a copy); larger ones in two
_SCRATCH_BYTES = 1 << 18  # what one read takes in at most, unless it goes into a frame's own buffer
CONNECT_SECONDS = 10.0     # an opener that offered to connect has this long to do it
TCP_SCHEME = "tcp://"      # an offered address of this form is a TCP socket (openers on other hosts)
_DIRECTORY = re.compile(r"shardtrain-link-(\d+)-\w+")
Placer = Callable[[shard_pb2.LinkMessage, int], "memoryview | None"]  # where a frame's data of that size goes


def encode(frame: Frame) -> tuple[bytes, object]:
    """(the frame's length, its message's length and the message, then the data): a frame's two parts on the socket."""
    head = frame.message.SerializeToString()
    data = frame.data
    return _PREFIX.pack(_PREFIX.size + len(head) + len(data)) + _PREFIX.pack(len(head)) + head, data


def decode(body: memoryview) -> Frame:
    """The Frame whose bytes (after the frame's length) are `body`; its data stays a view of `body`."""
    message, head_end = _head(body, len(body))
    return _checked(Frame(message, body[head_end:]))


def _head(body: memoryview, frame_size: int) -> tuple[shard_pb2.LinkMessage, int]:
    """The message at the start of a frame of `frame_size` bytes, of which `body` holds the first ones, and
    where its data starts."""
    if frame_size < _PREFIX.size:
        raise errors.DataLoss(f"local link: a frame of {frame_size} bytes is too short to hold its message's length")
    head_size = _PREFIX.unpack_from(body)[0]
    if head_size > frame_size - _PREFIX.size:
        raise errors.DataLoss(f"local link: a frame of {frame_size} bytes says its message has {head_size}")
    try:
        message = shard_pb2.LinkMessage.FromString(body[_PREFIX.size:_PREFIX.size + head_size])
    except DecodeError as error:
        raise errors.DataLoss(f"local link: a frame's message does not parse as a LinkMessage ({error})") from None
    enums.check(message)  # as the gRPC stream's items are (rpc.add_service)
    return message, _PREFIX.size + head_size


def _checked(frame: Frame) -> Frame:
    """The frame, once its data and its message's chunk agree."""
    message = frame.message
    chunk = frame.chunk
    if chunk is None:
        if len(frame.data):
            raise errors.DataLoss(f"local link: a {message.WhichOneof('item') or 'bare'} frame carries "
                                  f"{len(frame.data)} bytes of data but no tensor chunk")
    elif chunk.data:  # a sender that left the data in the message: valid protobuf, taken as such
        if len(frame.data):
            raise errors.DataLoss("local link: a tensor chunk has data both inside and after its message")
        frame.data = chunk.data
        chunk.ClearField("data")
    return frame


class Carrier(asyncio.BufferedProtocol):
    """One end of a connected socket: writes and reads Link frames, in order.

    Frames are cut from what each read of the socket brings, in the event loop's read callback, and
    handed to a consumer there and then (deliver), or queued for read(): no stream reader, no task
    woken per frame. Reads land in a scratch buffer, except the rest of a frame bigger than what one
    read brought: that goes straight from the socket into the tensor its data belongs to (or the
    frame's own buffer), copied once.
    """

    def __init__(self, on_token: Callable[[bytes, Carrier], None] | None = None):
        self._transport: asyncio.Transport | None = None
        self._on_token = on_token          # the listener's end: the first TOKEN_BYTES name the link
        self._token = bytearray()
        self._token_timer: asyncio.TimerHandle | None = None
        self._frames: collections.deque[Frame] = collections.deque()  # arrived before anyone asked
        self._consumer: Callable[[Frame], None] | None = None
        self._waiter: asyncio.Future | None = None    # read() waiting for a frame
        self._ended: asyncio.Future = asyncio.get_running_loop().create_future()  # None at the end, or an error
        self._paused: asyncio.Future | None = None    # writes wait while the socket's buffer is full
        self._length = bytearray()         # a frame's length prefix, while it arrives in pieces
        self._body: memoryview | None = None  # a frame's bytes (or, once placed, its data) while they arrive
        self._placed: shard_pb2.LinkMessage | None = None  # the message of a frame whose data is being placed
        self._place: Placer | None = None  # the consumer's: where a tensor chunk's data goes
        self._filled = 0
        # A memoryview, not the bytearray: asyncio's TLS transport reads into slices of what get_buffer returns,
        # and a slice of a bytearray is a copy, so the bytes would be lost (CPython gh-156275).
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        self._into_body = False            # the last buffer handed to the transport was the frame's own

    # --- protocol callbacks ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if self._on_token is not None:  # an opener that does not name its link in time is shown the door
            self._token_timer = asyncio.get_running_loop().call_later(CONNECT_SECONDS, transport.close)

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        self._into_body = self._body is not None and self._on_token is None
        return self._body[self._filled:] if self._into_body else self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._ended.done():
            return
        try:
            if self._into_body:
                self._filled += nbytes
                if self._filled == len(self._body):
                    self._complete()
                return
            data = self._scratch[:nbytes]
            if self._on_token is not None:
                data = self._take_token(data)
            self._cut(data)
        except Exception as error:  # noqa: BLE001 - a bad frame or a consumer's failure ends the link
            self._end(error)
            self.close()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost says whether a frame was cut

    def connection_lost(self, exc: Exception | None) -> None:
        if self._body is not None:
            self._end(errors.DataLoss(f"local link: the socket closed inside a frame of {len(self._body)} bytes"))
        elif self._length:
            self._end(errors.DataLoss("local link: the socket closed inside a frame's length"))
        else:
            self._end(None)  # a reset between frames is the other process ending too
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        if self._token_timer is not None:
            self._token_timer.cancel()

    def pause_writing(self) -> None:
        self._paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        self._paused = None

    # --- reading ------------------------------------------------------------------------------------
    def _take_token(self, data: memoryview) -> memoryview:
        needed = TOKEN_BYTES - len(self._token)
        self._token += data[:needed]
        if len(self._token) < TOKEN_BYTES:
            return data[:0]
        on_token, self._on_token = self._on_token, None
        self._token_timer.cancel()
        on_token(bytes(self._token), self)
        return data[needed:] if not self._transport.is_closing() else data[:0]

    def _cut(self, data: memoryview) -> None:
        """Cuts complete frames out of `data` (a view of the scratch buffer, so each is copied out) and keeps an
        incomplete tail."""
        view, position, end = data, 0, len(data)
        while position < end and not self._ended.done():
            if self._body is not None:  # the rest of a frame that began in an earlier read
                taken = min(end - position, len(self._body) - self._filled)
                self._body[self._filled:self._filled + taken] = view[position:position + taken]
                self._filled += taken
                position += taken
                if self._filled == len(self._body):
                    self._complete()
                continue
            if self._length or end - position < _PREFIX.size:  # a prefix cut in two
                taken = min(end - position, _PREFIX.size - len(self._length))
                self._length += view[position:position + taken]
                position += taken
                if len(self._length) < _PREFIX.size:
                    continue
                size = self._size(self._length)
                self._length.clear()
            else:
                size = self._size(view[position:position + _PREFIX.size])
                position += _PREFIX.size
            first = view[position:min(end, position + size)]
            position += len(first)
            self._begin(first, size)

    def _begin(self, first: memoryview, size: int) -> None:
        """Takes a frame of `size` bytes whose first bytes (all of them, or those this read brought) are `first`, a
        view of the scratch buffer; later reads fill in the rest."""
        placement = self._placement(first, size)
        if placement is None:
            self._body = memoryview(numpy.empty(size, numpy.uint8))  # uninitialized: every byte gets written
            self._body[:len(first)] = first
            self._filled = len(first)
        else:
            self._placed, head_end, self._body = placement
            self._filled = len(first) - head_end
            self._body[:self._filled] = first[head_end:]
        if self._filled == len(self._body):
            self._complete()

    def _placement(self, first: memoryview, size: int) -> tuple[shard_pb2.LinkMessage, int, memoryview] | None:
        """(message, where its data starts, where the consumer has it go) for a frame whose message is all in
        `first` and whose data the consumer places; None for any other frame."""
        if self._place is None or len(first) < _PREFIX.size:
            return None
        head_end = _PREFIX.size + _PREFIX.unpack_from(first)[0]
        if head_end > len(first) or head_end >= size:
            return None  # the message is cut in two, or the frame has no data: taken whole
        message, head_end = _head(first, size)
        chunk = Frame(message).chunk
        if chunk is None or chunk.data:
            return None  # decode() says what is wrong with it, or takes the data from the message
        target = self._place(message, size - head_end)
        return None if target is None else (message, head_end, target)

    def _complete(self) -> None:
        body, self._body = self._body, None
        placed, self._placed = self._placed, None
        if placed is None:
            self._arrived(body)
        else:
            self._hand(Frame(placed, body))

    @staticmethod
    def _size(prefix) -> int:
        size = _PREFIX.unpack(prefix)[0]
        if size > MAX_FRAME_BYTES:
            raise errors.DataLoss(f"local link: a frame of {size} bytes, more than the {MAX_FRAME_BYTES} allowed")
        return size

    def _arrived(self, body: memoryview) -> None:
        self._hand(decode(body))

    def _hand(self, frame: Frame) -> None:
        if self._consumer is not None:
            self._consumer(frame)
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(frame)
        else:
            self._frames.append(frame)

    def _end(self, error: BaseException | None) -> None:
        if self._ended.done():
            return
        if error is None:
            self._ended.set_result(None)
        else:
            self._ended.set_exception(error)
            self._ended.exception()  # retrieved: nobody may be reading
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def deliver(self, consumer: Callable[[Frame], None], place: Placer | None = None) -> None:
        """Hands each frame to `consumer` as it arrives, in the read callback, until the other end closes the
        socket; raises what ended it otherwise (a cut frame, or what `consumer` raised). `place` answers where
        a frame's data goes (a writable view of exactly that many bytes), or None for a buffer of its own."""
        try:
            while self._frames:
                consumer(self._frames.popleft())
        except Exception as error:  # noqa: BLE001 - as in data_received: the link ends with it
            self._end(error)
            self.close()
        self._consumer, self._place = consumer, place
        await self._ended

    async def read(self) -> Frame | None:
        """The next frame, or None when the other end closed (or reset) the socket between frames. One reader at a
        time, and not once deliver() took over."""
        if self._frames:
            return self._frames.popleft()
        if self._ended.done():
            self._ended.result()  # raises what cut the stream
            return None
        self._waiter = asyncio.get_running_loop().create_future()
        frame = await self._waiter
        if frame is None:
            self._ended.result()
        return frame

    # --- writing ------------------------------------------------------------------------------------
    async def write(self, frame: Frame) -> None:
        """Sends one frame; ConnectionError once the other end is gone."""
        await self._send(*encode(frame))

    async def _send(self, head: bytes, data) -> None:
        """Writes a frame's length and head, then its data."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("local link: the socket is closed")
        if len(data) <= _JOIN_BYTES:
            transport.write(b"".join((head, data)))  # one send: a send is what wakes the reader
        else:
            transport.write(head)
            transport.write(data)
        if self._paused is not None:
            await self._paused

    def close(self) -> None:
        """Closes the socket; the other end reads its end."""
        if self._transport is not None:
            self._transport.close()


async def connect(address: str, token: bytes, tls: ssl.SSLContext | None = None, server_name: str = "") -> Carrier:
    """The opener's carrier: connects to `address` (a Unix socket's path, or tcp://host:port) and names the link
    by `token`. A TCP socket speaks TLS with `tls`, checking the certificate against `server_name` (default: the
    address's host), as the gRPC channel to the same peer does."""
    loop = asyncio.get_running_loop()
    if address.startswith(TCP_SCHEME):
        host, _, port = address[len(TCP_SCHEME):].rpartition(":")
        host = host.strip("[]")
        connecting = loop.create_connection(Carrier, host, int(port), ssl=tls,
                                            server_hostname=(server_name or host) if tls is not None else None)
    else:
        connecting = loop.create_unix_connection(Carrier, address)
    _, local = await asyncio.wait_for(connecting, CONNECT_SECONDS)
    local._transport.write(token)
    return local


async def over(sock) -> Carrier:
    """A carrier on a socket that is already connected (one end of a socketpair)."""
    _, local = await asyncio.get_running_loop().create_unix_connection(Carrier, sock=sock)
    return local


class Listener:
    """The answering ends' sockets: hands each connection to the Link whose token it presents.

    A Unix socket for openers on this host (`unix`), and a TCP one for openers on other hosts when given
    `tcp_bind` (the host to listen on) and `tcp_advertise` (the host they reach it by), over TLS with `tls`
    (the opener's token and every frame after it are then encrypted)."""

    def __init__(self, unix: bool = True, tcp_bind: str = "", tcp_advertise: str = "",
                 tls: ssl.SSLContext | None = None) -> None:
        self._unix = unix
        self._server: asyncio.AbstractServer | None = None
        self._directory = ""
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._cannot: OSError | None = None  # why this host gives no socket (a path too long, ...): asked once
        self._tcp_bind, self._tcp_advertise, self._tls = tcp_bind, tcp_advertise, tls
        self._tcp: asyncio.AbstractServer | None = None
        self._tcp_address = ""

    @property
    def address(self) -> str:
        """The socket's path."""
        return os.path.join(self._directory, "link.sock")

    async def offer(self, same_host: bool = True) -> tuple[str, bytes, asyncio.Future]:
        """(address, token, future of the Carrier that presents the token) for one Link: the Unix socket for an
        opener on this host, the TCP one for another; OSError if there is none for it (then items stay on the
        gRPC stream)."""
        if same_host:
            if not self._unix:
                raise OSError("no local links: --local-links off")
            if self._cannot is not None:
                raise self._cannot
            if self._server is None:
                await self._start()
            address = self.address
        else:
            if not self._tcp_bind:
                raise OSError("no TCP links to this shard")
            if self._tcp is None:
                self._tcp = await asyncio.get_running_loop().create_server(
                    lambda: Carrier(on_token=self._presented), self._tcp_bind, 0, ssl=self._tls,
                    ssl_handshake_timeout=CONNECT_SECONDS if self._tls is not None else None)
                port = self._tcp.sockets[0].getsockname()[1]
                host = f"[{self._tcp_advertise}]" if ":" in self._tcp_advertise else self._tcp_advertise
                self._tcp_address = f"{TCP_SCHEME}{host}:{port}"
            address = self._tcp_address
        token = secrets.token_bytes(TOKEN_BYTES)
        future = asyncio.get_running_loop().create_future()
        self._waiting[token] = future
        return address, token, future

    async def _start(self) -> None:
        try:
            self._directory = tempfile.mkdtemp(prefix=f"shardtrain-link-{os.getpid()}-")  # mode 0700
            self._server = await asyncio.get_running_loop().create_unix_server(
                lambda: Carrier(on_token=self._presented), self.address)
        except OSError as error:  # e.g. macOS's 104-byte limit on a socket's path
            shutil.rmtree(self._directory, ignore_errors=True)
            log.warning("no local links on this host (%s); Link items stay on gRPC streams", error)
            self._cannot = error
            raise

    def withdraw(self, token: bytes) -> None:
        """Forgets an offer the opener declined or will never take up."""
        future = self._waiting.pop(token, None)
        if future is not None and not future.done():
            future.cancel()

    def _presented(self, token: bytes, local: Carrier) -> None:
        future = self._waiting.pop(token, None)
        if future is None or future.done():
            log.warning("a local link presented a token no Link offered; closed it")
            local.close()
            return
        future.set_result(local)

    async def close(self) -> None:
        """Stops listening and removes the socket's directory."""
        for token in list(self._waiting):
            self.withdraw(token)
        if self._server is not None:
            # Stops listening at once. Not wait_closed(): from Python 3.12 it waits for every accepted
            # socket, and those belong to Links that end when the server stops, after this.
            self._server.close()
            shutil.rmtree(self._directory, ignore_errors=True)
            self._server = None
        if self._tcp is not None:
            self._tcp.close()
            self._tcp = None


def sweep() -> list[str]:
    """Removes the socket directories of shardtrain processes that no longer exist; returns their paths."""
    removed = []
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        match = _DIRECTORY.fullmatch(name)
        if match and not shm.process_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
    return removed

