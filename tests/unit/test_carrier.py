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

from shardtrain import carrier, errors, link, wire
from shardtrain.v1 import shard_pb2

KEY = shard_pb2.StepKey(deployment_id="d", step=3)


async def connected_pair() -> tuple[carrier.Carrier, carrier.Carrier]:
    left, right = socket.socketpair(socket.AF_UNIX)
    ends = [carrier.Carrier(*await asyncio.open_unix_connection(sock=sock)) for sock in (left, right)]
    return ends[0], ends[1]


def test_frames_cross_whole_and_in_order():
    async def run():
        sender, receiver = await connected_pair()
        activation = torch.randn(64, 33)
        frames = [*link.frames(shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader(key=KEY)), activation,
                               wire.SendOptions(chunk_bytes=1000)),
                  *link.frames(shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=KEY)))]
        for frame in frames:
            await sender.write(frame)
        sender.close()
        reader, items = link.ItemReader(), []
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
        receiver = carrier.Carrier(*await asyncio.open_unix_connection(sock=right))
        try:
            await receiver.read()
        finally:
            receiver.close()
    with pytest.raises(errors.DataLoss, match=match):
        asyncio.run(run())


def test_the_listener_hands_a_connection_to_the_offer_whose_token_it_presents():
    async def run():
        listener = carrier.Listener()
        try:
            address, token, offered = await listener.offer()
            _, other_token, other = await listener.offer()
            mode = stat.S_IMODE(os.stat(os.path.dirname(address)).st_mode)
            opener = await carrier.connect(address, token)
            answering = await asyncio.wait_for(offered, 5)
            await opener.write(next(link.frames(shard_pb2.LinkMessage(flush=shard_pb2.Flush(optimizer_step=4)))))
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
