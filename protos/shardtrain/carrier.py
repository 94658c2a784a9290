"""The same-host carrier of a Link: a Unix socket that takes the Link's items off its gRPC stream.

Why: in grpc.aio every message costs a completion-queue event, which grpc's poller thread hands to
the event loop through a socket, and every write waits for one. `python -m bench.rpc_overhead`
(two processes on the 2-core development machine, 2000 exchanges, medians of 2 rounds): a
ping-pong on an open gRPC stream cost 335 us and 0.42 ms of CPU (both sides together) for 100
bytes, the same ping-pong of Link frames on this socket 174 us and 0.155 ms (0.37x the CPU); for
64 KiB 369 us / 0.47 ms against 198 us / 0.215 ms (0.46x). Same-host Links are common: a host with
several GPUs runs one shard per GPU, and every local cluster is one. TensorPipe, under
torch.distributed.rpc, makes the same choice with its shm transport.

The Link's gRPC stream still opens, authenticates and ends the link: the socket is offered in the
answer to the open item, with a random token that only the (authenticated) opener learns, and it
lives in a directory only this user can enter. A frame on the socket is a 4-byte little-endian
length, then the frame's bytes exactly as the gRPC stream would carry them (shardtrain.codec).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import shutil
import struct
import tempfile
from collections.abc import AsyncIterator

from shardtrain import errors, shm
from shardtrain.codec import Codec, Frame
from shardtrain.v1 import shard_pb2

log = logging.getLogger("shardtrain.carrier")

_LENGTH = struct.Struct("<I")
TOKEN_BYTES = 16
MAX_FRAME_BYTES = 1 << 30  # a frame holds one chunk (64 MiB at most) or a small item
_JOIN_BYTES = 1 << 16     # frames up to this size go in one send (a copy); larger ones in two
CONNECT_SECONDS = 10.0     # an opener that offered to connect has this long to do it
_CODEC = Codec(shard_pb2.LinkMessage)
_DIRECTORY = re.compile(r"shardtrain-link-(\d+)-\w+")


class Carrier:
    """One end of a connected socket: writes and reads Link frames, in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer

    async def write(self, frame: Frame) -> None:
        """Sends one frame; ConnectionError once the other end is gone."""
        data = _CODEC.serialize(frame)
        if len(data) <= _JOIN_BYTES:
            self._writer.write(_LENGTH.pack(len(data)) + data)  # one send: a send is what wakes the reader
        else:
            self._writer.write(_LENGTH.pack(len(data)))
            self._writer.write(data)
        await self._writer.drain()

    async def read(self) -> Frame | None:
        """The next frame, or None when the other end closed (or reset) the socket between frames."""
        try:
            head = await self._reader.readexactly(_LENGTH.size)
        except ConnectionError:  # reset: the other process died
            return None
        except asyncio.IncompleteReadError as error:
            if error.partial:
                raise errors.DataLoss("local link: the socket closed inside a frame's length") from None
            return None
        size = _LENGTH.unpack(head)[0]
        if size > MAX_FRAME_BYTES:
            raise errors.DataLoss(f"local link: a frame of {size} bytes, more than the {MAX_FRAME_BYTES} allowed")
        try:
            return _CODEC.deserialize(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            raise errors.DataLoss(f"local link: the socket closed inside a frame of {size} bytes") from None

    async def frames(self) -> AsyncIterator[Frame]:
        """The frames that arrive, until the other end closes the socket."""
        while (frame := await self.read()) is not None:
            yield frame

    def close(self) -> None:
        """Closes the socket; the other end reads its end."""
        self._writer.close()


async def connect(address: str, token: bytes) -> Carrier:
    """The opener's carrier: connects to `address` and names the link by `token`."""
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(address), CONNECT_SECONDS)
    writer.write(token)
    return Carrier(reader, writer)


class Listener:
    """The answering ends' socket: hands each connection to the Link whose token it presents."""

    def __init__(self) -> None:
        self._server: asyncio.AbstractServer | None = None
        self._directory = ""
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._cannot: OSError | None = None  # why this host gives no socket (a path too long, ...): asked once

    @property
    def address(self) -> str:
        """The socket's path."""
        return os.path.join(self._directory, "link.sock")

    async def offer(self) -> tuple[str, bytes, asyncio.Future]:
        """(address, token, future of the Carrier that presents the token) for one Link; OSError if this
        host cannot listen on a Unix socket (then items stay on the gRPC stream)."""
        if self._cannot is not None:
            raise self._cannot
        if self._server is None:
            await self._start()
        token = secrets.token_bytes(TOKEN_BYTES)
        future = asyncio.get_running_loop().create_future()
        self._waiting[token] = future
        return self.address, token, future

    async def _start(self) -> None:
        try:
            self._directory = tempfile.mkdtemp(prefix=f"shardtrain-link-{os.getpid()}-")  # mode 0700
            self._server = await asyncio.start_unix_server(self._accept, self.address)
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

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), CONNECT_SECONDS)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            writer.close()
            return
        future = self._waiting.pop(token, None)
        if future is None or future.done():
            log.warning("a local link presented a token no Link offered; closed it")
            writer.close()
            return
        future.set_result(Carrier(reader, writer))

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

