"""Links between same-host parties carry their items on a Unix socket; the gRPC stream stays the fallback."""

from __future__ import annotations

import asyncio
import glob
import os
import tempfile

import pytest
import torch
from torch import nn

from client_sdk import Cluster
from shardtrain import carrier, errors, link_streams, rpc
from shardtrain.codec import Frame
from shardtrain.settings import Security
from shardtrain.v1 import shard_pb2
from tests.integration.training import largest_difference, regression_batches, train_locally, train_remotely

KEY = shard_pb2.StepKey(deployment_id="d", step=1)
ADAM = (torch.optim.Adam, {"lr": 1e-2})


class EchoShard:
    """A ShardService that answers Links only, sending every item back on the link it came by."""

    location = "echo shard"

    def __init__(self, listener: carrier.Listener | None):
        self.listener = listener
        self.ends: list[link_streams.LinkEnd] = []

    @rpc.boundary
    async def Link(self, requests, context):  # noqa: N802 - the RPC's name
        def on_item(end, message, tensor):
            if message.HasField("flush") and message.flush.optimizer_step < 0:
                end.close_carrier()  # the test's way to make this end's socket go away
                return
            asyncio.ensure_future(end.send(message, tensor))
        await link_streams.serve(requests, context, "echo shard", lambda opening, end: self.ends.append(end), on_item,
                                 lambda end: None, self.listener)


async def echo_server(listener: carrier.Listener | None):
    server = rpc.new_server(Security())
    port = rpc.bind(server, "127.0.0.1:0", Security())
    shard = EchoShard(listener)
    rpc.add_service(server, shard, rpc.SHARD_SERVICE)
    await server.start()
    return server, rpc.Peer("echo shard", f"127.0.0.1:{port}", rpc.SHARD_SERVICE, Security(), timeout=30), shard


async def echoed(client_ask: bool, listener: carrier.Listener | None, before=None, opening=None):
    """Sends three items over a Link to an EchoShard; returns them as they came back, and both ends."""
    server, peer, shard = await echo_server(listener)
    received: asyncio.Queue = asyncio.Queue()
    try:
        if before is not None:
            await before()
        client = link_streams.ClientLink(peer, opening or shard_pb2.LinkOpen(local_carrier=client_ask),
                                         lambda end, message, tensor: received.put_nowait((message, tensor)),
                                         lambda end, error: received.put_nowait(error))
        activation = torch.randn(300, 20)
        await client.send(shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader(key=KEY)), activation)
        await client.send(shard_pb2.LinkMessage(backward=shard_pb2.BackwardHeader(key=KEY)))
        await client.send(shard_pb2.LinkMessage(flush=shard_pb2.Flush(optimizer_step=7)))
        items = [await asyncio.wait_for(received.get(), 10) for _ in range(3)]
        local = (client.local, shard.ends[0].local)
        await client.close()
        return activation, items, local
    finally:
        await server.stop(None)
        await peer.close()
        if listener is not None:
            await listener.close()


def check_echo(activation, items) -> None:
    assert [message.WhichOneof("item") for message, _ in items] == ["forward", "backward", "flush"]
    assert torch.equal(items[0][1], activation)
    assert items[2][0].flush.optimizer_step == 7


def test_items_go_both_ways_on_the_offered_socket():
    activation, items, local = asyncio.run(echoed(True, carrier.Listener()))
    check_echo(activation, items)
    assert local == (True, True)


@pytest.mark.parametrize("ask", [True, False], ids=["no listener", "not asked"])
def test_without_an_offer_items_stay_on_the_stream(ask):
    activation, items, local = asyncio.run(echoed(ask, carrier.Listener() if not ask else None))
    check_echo(activation, items)
    assert local == (False, False)


def test_an_opener_that_cannot_reach_the_socket_declines_it_and_items_stay_on_the_stream():
    listener = carrier.Listener()

    async def remove_the_socket():
        _, token, _ = await listener.offer()  # starts listening
        listener.withdraw(token)
        os.unlink(listener.address)  # connecting by path now fails
    activation, items, local = asyncio.run(echoed(True, listener, remove_the_socket))
    check_echo(activation, items)
    assert local == (False, False)


def test_a_host_without_unix_sockets_answers_without_an_offer(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # a socket path over Linux's 108 bytes, like macOS's /var/folders
    deep.mkdir(parents=True)
    monkeypatch.setattr(carrier.tempfile, "mkdtemp", lambda prefix: str(deep))
    activation, items, local = asyncio.run(echoed(True, carrier.Listener()))
    check_echo(activation, items)
    assert local == (False, False)


def test_an_opener_that_neither_connects_nor_declines_is_refused_with_unavailable(monkeypatch):
    monkeypatch.setattr(carrier, "CONNECT_SECONDS", 0.5)

    async def run():
        listener = carrier.Listener()
        server, peer, _ = await echo_server(listener)
        try:
            call = peer.stub.Link()
            await call.write(Frame(shard_pb2.LinkMessage(open=shard_pb2.LinkOpen(local_carrier=True))))
            answer = await call.read()
            return answer.message.open, await call.code(), await call.details()
        finally:
            await server.stop(None)
            await peer.close()
            await listener.close()
    answer, code, details = asyncio.run(run())
    assert answer.local_address and len(answer.local_token) == carrier.TOKEN_BYTES
    assert code.name == "UNAVAILABLE"
    assert "neither took the offered local link nor declined it within 0.5 s" in details


def test_the_opener_hears_when_the_socket_closes():
    async def run():
        listener = carrier.Listener()
        server, peer, _ = await echo_server(listener)
        broken: asyncio.Future = asyncio.get_running_loop().create_future()
        try:
            client = link_streams.ClientLink(peer, shard_pb2.LinkOpen(local_carrier=True), lambda *item: None,
                                             lambda end, error: broken.set_result(error))
            await client.send(shard_pb2.LinkMessage(flush=shard_pb2.Flush(optimizer_step=-1)))
            error = await asyncio.wait_for(broken, 10)
            with pytest.raises(errors.Unavailable):
                await client.send(shard_pb2.LinkMessage(flush=shard_pb2.Flush(optimizer_step=1)))
            await client.close()
            return error
        finally:
            await server.stop(None)
            await peer.close()
            await listener.close()
    error = asyncio.run(run())
    assert isinstance(error, errors.Unavailable)
    assert "echo shard is unavailable: its local link closed" in str(error)


def small_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def sockets_of(pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"shardtrain-link-{pid}-*", "link.sock"))


def connections_to(path: str) -> int:
    """Connected Unix sockets bound to `path` (the listener's accepted ends), from /proc/net/unix."""
    with open("/proc/net/unix") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if len(row) == 8 and row[7] == path and row[5] == "03")


def test_same_host_stages_and_the_sdk_carry_link_items_on_local_sockets(cluster4):
    batches = regression_batches(steps=5, batch=16, features=8)
    model = cluster4.deploy(small_net(), optimizer=ADAM, num_stages=3)
    train_remotely(model, batches)
    assert largest_difference(model.state_dict(), train_locally(small_net(), batches, ADAM)) < 1e-5
    by_address = {service.address: service.process.pid for service in cluster4._services.services[1:]}
    for placement in model.placements:  # every stage answers a link: the SDK's or the stage before's
        paths = sockets_of(by_address[placement.shard_address])
        assert len(paths) == 1 and connections_to(paths[0]) >= 1, f"stage {placement.stage} has no local link"


def test_with_local_links_off_items_take_the_grpc_streams_and_training_matches(monkeypatch):
    monkeypatch.setenv("SHARDTRAIN_LOCAL_LINKS", "off")
    batches = regression_batches(steps=5, batch=16, features=8)
    with Cluster.local(num_shards=2) as cluster:
        model = cluster.deploy(small_net(), optimizer=ADAM, num_stages=2)
        train_remotely(model, batches)
        assert largest_difference(model.state_dict(), train_locally(small_net(), batches, ADAM)) < 1e-5
        assert not [path for pid in cluster._services.pids for path in sockets_of(pid)]


def tcp_listeners(pid: int) -> int:
    """TCP sockets process `pid` listens on."""
    return len(listening_ports(pid))


def tcp_table(pid: int) -> list[tuple[int, str, str]]:
    """(local port, state, inode) of every TCP socket in process `pid`'s network namespace (/proc/PID/net/tcp{,6}):
    state 0A listens, 01 is established."""
    rows = []
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        with open(table) as lines:
            rows += [(int(row[1].rsplit(":", 1)[1], 16), row[3], row[9])
                     for row in (line.split() for line in lines.readlines()[1:])]
    return rows


def established_on(pid: int, port: int) -> int:
    """Connections made to process `pid`'s local `port`."""
    return sum(1 for local, state, _ in tcp_table(pid) if state == "01" and local == port)


def listening_ports(pid: int) -> list[int]:
    """The ports of the TCP sockets process `pid` listens on (its own, by its file descriptors)."""
    inodes = set()
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return [local for local, state, inode in tcp_table(pid) if state == "0A" and inode in inodes]


@pytest.mark.parametrize("tcp", ["on", "off"])
def test_between_hosts_items_take_a_tcp_socket_unless_told_not_to_and_training_matches(monkeypatch, tcp):
    """Without shared memory no shard can prove it shares a host with another, as on separate machines: the links
    between stages ask for a TCP socket, which the next stage opens once asked (a second listening socket beside
    its gRPC port), or stay on the gRPC stream with --tcp-links off."""
    monkeypatch.setenv("SHARDTRAIN_SHARED_MEMORY", "off")
    monkeypatch.setenv("SHARDTRAIN_TCP_LINKS", tcp)
    batches = regression_batches(steps=5, batch=16, features=8)
    with Cluster.local(num_shards=2) as cluster:
        model = cluster.deploy(small_net(), optimizer=ADAM, num_stages=2)
        train_remotely(model, batches)
        assert largest_difference(model.state_dict(), train_locally(small_net(), batches, ADAM)) < 1e-5
        by_address = {service.address: service.process.pid for service in cluster._services.services[1:]}
        second = by_address[model.placements[1].shard_address]
        assert tcp_listeners(second) == (2 if tcp == "on" else 1)
