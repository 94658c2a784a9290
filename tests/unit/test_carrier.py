"""shardtrain.carrier: Link frames cross a Unix socket whole and in order; only the offered token gets a link."""

from __future__ import annotations

import asyncio
import os
import pathlib
import socket
import stat
import subprocess
import sys
import tempfile

import pytest
import torch

from shardtrain import carrier, errors, link_streams, wire
from shardtrain.v1 import shard_pb2, tensor_pb2

KEY = shard_pb2.StepKey(deployment_id="d", step=3)


async def connected_pair() -> tuple[carrier.Carrier, carrier.Carrier]:
    left, right = socket.socketpair(socket.AF_UNIX)
    ends = [await carrier.over(sock) for sock in (left, right)]
    return ends[0], ends[1]


def test_frames_cross_whole_and_in_order():
    async def run():
        sender, receiver = await connected_pair()
        activation = torch.randn(64, 33)
        frames = [*link_streams.frames(shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader(key=KEY)), activation,
                                       wire.SendOptions(chunk_bytes=1000)),
                  *link_streams.frames(shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=KEY)))]
        for frame in frames:
            await sender.write(frame)
        sender.close()
        reader, items = link_streams.ItemReader(), []
        while (frame := await receiver.read()) is not None:
            items.append(reader.feed(frame))
        receiver.close()
        return activation, [item for item in items if item is not None]
    activation, items = asyncio.run(run())
    assert [message.WhichOneof("item") for message, _ in items] == ["forward", "backward"]
    assert torch.equal(items[0][1], activation) and items[1][1] is None


@pytest.mark.parametrize(("raw", "match"), [(b"\x05\x00", "inside a frame's length"),
                                             (b"\x05\x00\x00\x00ab", "inside a frame of 5 bytes"),
                                             (b"\xff\xff\xff\xff", "more than the 1073741824 allowed")])
def test_a_cut_or_oversized_frame_is_data_loss(raw, match):
    async def run():
        left, right = socket.socketpair(socket.AF_UNIX)
        left.sendall(raw)
        left.close()
        receiver = await carrier.over(right)
        try:
            await receiver.read()
        finally:
            receiver.close()
    with pytest.raises(errors.DataLoss, match=match):
        asyncio.run(run())


def item_frames() -> tuple[torch.Tensor, list]:
    """Three items' frames: a forward with a 64x33 activation in 1000-byte chunks, a backward, a flush."""
    activation = torch.randn(64, 33)
    forward = shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader(key=KEY))
    return activation, [*link_streams.frames(forward, activation, wire.SendOptions(chunk_bytes=1000)),
                        *link_streams.frames(shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=KEY))),
                        *link_streams.frames(shard_pb2.LinkMessage(flush=shard_pb2.Flush(optimizer_step=2)))]


def feed(receiver: carrier.Carrier, data: bytes) -> None:
    """What the event loop does with one read of `data`: into the buffers the carrier hands out, in turn."""
    view = memoryview(data)
    while view:
        buffer = receiver.get_buffer(len(view))
        size = min(len(buffer), len(view))
        buffer[:size] = view[:size]
        receiver.buffer_updated(size)
        view = view[size:]


@pytest.mark.parametrize("piece", [1, 3, 7, 1000, 1 << 20])
def test_frames_are_cut_whole_however_the_reads_split_or_join_them(piece):
    """Reads may end anywhere: inside a length, a message or the data, or hold many frames at once."""
    async def run():
        activation, frames = item_frames()
        raw = b"".join(bytes(part) for frame in frames for part in carrier.encode(frame))
        receiver = carrier.Carrier()
        for start in range(0, len(raw), piece):
            feed(receiver, raw[start:start + piece])
        receiver.connection_lost(None)
        reader, items = link_streams.ItemReader(), []
        while (frame := await receiver.read()) is not None:
            items.append(reader.feed(frame))
        return activation, [item for item in items if item is not None], len(frames)
    activation, items, count = asyncio.run(run())
    assert count > 10, "the activation spans many frames"
    assert [message.WhichOneof("item") for message, _ in items] == ["forward", "backward", "flush"]
    assert torch.equal(items[0][1], activation)
    assert items[2][0].flush.optimizer_step == 2


@pytest.mark.parametrize(("piece", "placed_chunks"), [(1, range(0, 1)), (7, range(0, 1)), (1000, range(1, 10)),
                                                      (1 << 20, range(9, 10))])
def test_a_delivered_tensor_chunk_is_received_straight_into_its_tensor(piece, placed_chunks):
    """A chunk whose message arrives whole in one read has its data go straight into the tensor being assembled;
    one whose message is cut by a read takes a buffer of its own; the items are the same either way."""
    async def run():
        activation, frames = item_frames()
        raw = b"".join(bytes(part) for frame in frames for part in carrier.encode(frame))
        receiver, reader, items, placed = carrier.Carrier(), link_streams.ItemReader(), [], []

        def place(message, nbytes):
            target = reader.place(message, nbytes)
            placed.append(target is not None)
            return target
        delivering = asyncio.ensure_future(receiver.deliver(lambda frame: items.append(reader.feed(frame)), place))
        await asyncio.sleep(0)
        for start in range(0, len(raw), piece):
            feed(receiver, raw[start:start + piece])
        receiver.connection_lost(None)
        await delivering
        return activation, [item for item in items if item is not None], placed
    activation, items, placed = asyncio.run(run())
    assert [message.WhichOneof("item") for message, _ in items] == ["forward", "backward", "flush"]
    assert torch.equal(items[0][1], activation)
    assert sum(placed) in placed_chunks  # of the activation's 9 chunks


def test_deliver_hands_over_frames_that_came_before_and_after_it_was_called():
    async def run():
        sender, receiver = await connected_pair()
        _, frames = item_frames()
        for frame in frames[:3]:
            await sender.write(frame)
        await asyncio.sleep(0.05)  # they arrive with nobody to take them
        seen = []

        async def rest():
            for frame in frames[3:]:
                await sender.write(frame)
            sender.close()
        writing = asyncio.ensure_future(rest())
        await asyncio.wait_for(receiver.deliver(seen.append), 5)  # returns when the sender closes
        await writing
        return [frame.message for frame in frames], [frame.message for frame in seen]
    sent, seen = asyncio.run(run())
    assert seen == sent


def test_a_consumer_that_raises_ends_the_link_with_its_error():
    async def run():
        sender, receiver = await connected_pair()
        _, frames = item_frames()

        def refuse(frame):
            raise errors.InvalidArgument("no such item here")
        for frame in frames:
            await sender.write(frame)
        await asyncio.sleep(0.05)  # some arrive before deliver() is called, and are handed over by it
        try:
            await asyncio.wait_for(receiver.deliver(refuse), 5)
        except errors.InvalidArgument as error:
            return error, await asyncio.wait_for(sender.read(), 5)
        finally:
            sender.close()
    error, after = asyncio.run(run())
    assert "no such item here" in str(error)
    assert after is None, "the receiving end closed its socket"


@pytest.mark.parametrize(("body", "match"), [
    (b"\x01\x00", "too short to hold its message's length"),
    (b"\x09\x00\x00\x00ab", "says its message has 9"),
    (b"\x02\x00\x00\x00\xff\xff", "does not parse as a LinkMessage"),
    (b"\x00\x00\x00\x00data", "carries 4 bytes of data but no tensor chunk")])
def test_a_malformed_frame_is_data_loss(body, match):
    with pytest.raises(errors.DataLoss, match=match):
        carrier.decode(memoryview(body))


def test_data_left_inside_the_message_is_taken_as_the_frames_data():
    """Another implementation may send the chunk's data as the protobuf field itself: still valid."""
    chunk = shard_pb2.LinkMessage(tensor=tensor_pb2.TensorChunk(offset=0, data=b"abcd"))
    head = chunk.SerializeToString()
    frame = carrier.decode(memoryview(len(head).to_bytes(4, "little") + head))
    assert bytes(frame.data) == b"abcd" and frame.chunk.data == b""


def test_the_listener_hands_a_connection_to_the_offer_whose_token_it_presents():
    async def run():
        listener = carrier.Listener()
        try:
            address, token, offered = await listener.offer()
            _, other_token, other = await listener.offer()
            mode = stat.S_IMODE(os.stat(os.path.dirname(address)).st_mode)
            opener = await carrier.connect(address, token)
            answering = await asyncio.wait_for(offered, 5)
            flush = shard_pb2.LinkMessage(flush=shard_pb2.Flush(optimizer_step=4))
            await opener.write(next(link_streams.frames(flush)))
            received = await answering.read()
            opener.close()
            answering.close()
            return mode, received.message.flush.optimizer_step, other.done(), other_token != token
        finally:
            await listener.close()
    mode, optimizer_step, other_done, distinct = asyncio.run(run())
    assert mode == 0o700, "only this user may reach the socket"
    assert optimizer_step == 4
    assert not other_done and distinct, "each offer waits for its own token"


def test_a_token_nobody_offered_gets_the_socket_closed_and_the_listener_serves_on():
    async def run():
        listener = carrier.Listener()
        try:
            address, token, offered = await listener.offer()
            stranger = await carrier.connect(address, b"x" * carrier.TOKEN_BYTES)
            refused = await asyncio.wait_for(stranger.read(), 5)
            stranger.close()
            opener = await carrier.connect(address, token)
            accepted = await asyncio.wait_for(offered, 5)
            opener.close()
            accepted.close()
            return refused, accepted
        finally:
            await listener.close()
    refused, accepted = asyncio.run(run())
    assert refused is None, "the stranger's socket was closed"
    assert isinstance(accepted, carrier.Carrier)


def test_close_removes_the_socket_and_withdraws_open_offers():
    async def run():
        listener = carrier.Listener()
        address, _, offered = await listener.offer()
        await listener.close()
        return address, offered
    address, offered = asyncio.run(run())
    assert offered.cancelled()
    assert not os.path.exists(os.path.dirname(address))


def test_sweep_removes_the_sockets_of_dead_processes_only():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    root = pathlib.Path(tempfile.gettempdir())
    orphan = root / f"shardtrain-link-{dead.stdout.strip()}-test"
    mine = root / f"shardtrain-link-{os.getpid()}-test"
    orphan.mkdir()
    mine.mkdir()
    try:
        removed = carrier.sweep()
        assert str(orphan) in removed and not orphan.exists()
        assert mine.exists()
    finally:
        mine.rmdir()
