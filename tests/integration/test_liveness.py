"""The coordinator places stages only on shards that answer, and a shard keeps its registration alive."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import time

import pytest
import torch
from torch import nn

from client_sdk import Cluster
from coordinator.server import build_server
from shard_service.server import keep_registered
from shardtrain import errors, rpc
from shardtrain.settings import CoordinatorSettings, Security, ShardSettings, Timeouts
from shardtrain.v1 import coordinator_pb2, shard_pb2
from tests.integration.training import trains_like_one_process


@pytest.mark.parametrize("own_cluster", [2], indirect=True)
def test_a_registration_that_does_not_answer_is_forgotten_at_deploy_and_the_deploy_goes_on(own_cluster):
    cluster = own_cluster
    rogue = coordinator_pb2.RegisterShardRequest(address="127.0.0.1:1", device="cpu")  # nothing listens there
    cluster._io.run(cluster._coordinator.call("RegisterShard", rogue))
    assert len(cluster.shards()) == 3
    # Every registered shard by default: before, the rogue got a stage and every later deploy failed.
    assert trains_like_one_process(cluster, num_stages=0) <= 1e-5
    assert sorted(s.address for s in cluster.shards()) == sorted(cluster._services.shard_addresses)


def test_a_shard_registers_again_at_every_heartbeat():
    async def scenario() -> list[float]:
        coordinator = CoordinatorSettings(security=Security(token="t"))
        server, port, servicer = await build_server(coordinator)
        shard = ShardSettings(coordinator=f"127.0.0.1:{port}", security=Security(token="t"),
                              timeouts=dataclasses.replace(Timeouts(), heartbeat=0.05))
        beating = asyncio.ensure_future(keep_registered(shard, "127.0.0.1:5"))
        heard = []
        try:
            for _ in range(4):
                await asyncio.sleep(0.1)
                heard.append(servicer.registry._heard.get("127.0.0.1:5", 0.0))
        finally:
            beating.cancel()
            await server.stop(None)
        return heard
    heard = asyncio.run(scenario())
    assert heard[0] > 0 and all(later > earlier for earlier, later in zip(heard, heard[1:])), heard


def test_a_dead_shard_s_registration_expires_within_seconds_and_the_live_ones_stay():
    with Cluster.local(num_shards=2, timeouts=Timeouts(heartbeat=0.2, expiry=1.0)) as cluster:
        dead, alive = cluster._services.services[1], cluster._services.services[2]
        os.kill(dead.process.pid, signal.SIGKILL)
        dead.process.wait()
        start = time.monotonic()
        while dead.address in [s.address for s in cluster.shards()] and time.monotonic() - start < 10:
            time.sleep(0.1)
        gone = time.monotonic() - start
        assert [s.address for s in cluster.shards()] == [alive.address]
        assert gone <= 1.0 + 2.0, gone  # the expiry, and a margin for a loaded machine
        time.sleep(1.5)
        assert [s.address for s in cluster.shards()] == [alive.address]  # its heartbeats keep it


def test_a_stopped_shard_is_named_when_a_call_runs_out_of_its_deadline_and_training_goes_on_once_it_resumes():
    """SIGSTOP on the middle stage: the output the client waits for is the last stage's, but the message names the
    stage that does not answer, after the deadline the user set rather than two minutes."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with Cluster.local(num_shards=3, timeouts=Timeouts(rpc=4.0, peer_wait=4.0, probe=1.0)) as cluster:
        model = cluster.deploy(net, num_stages=3)
        x = torch.randn(8, 4)
        with torch.no_grad():
            model(x)
        middle = next(s for s in cluster._services.services if s.address == model.placements[1].shard_address)
        os.kill(middle.process.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded, match=rf"did not arrive within 4 s; shard at "
                                                              rf"{middle.address} \(stage 1\) did not answer within "
                                                              r"1 s \(stopped, hung or gone\)"):
                with torch.no_grad():
                    model(x)
            assert time.monotonic() - start < 15
        finally:
            os.kill(middle.process.pid, signal.SIGCONT)
        with torch.no_grad():
            assert torch.allclose(model(x), net(x), atol=1e-6)


@pytest.mark.parametrize("own_cluster", [2], indirect=True)
def test_a_deploy_probes_only_the_shards_it_takes_however_many_have_registered(own_cluster):
    """Registrations beyond the shards a deploy takes are not probed (bench.scale times this with 1,000): with 200
    silent ones registered after the two live shards, a two-stage deploy trains and leaves them registered."""
    cluster = own_cluster
    for port in range(10_000, 10_200):  # 127.0.0.2 is loopback, where nothing listens
        crowd = coordinator_pb2.RegisterShardRequest(address=f"127.0.0.2:{port}", device="cpu")
        cluster._io.run(cluster._coordinator.call("RegisterShard", crowd))
    assert trains_like_one_process(cluster, num_stages=2) <= 1e-5
    assert len(cluster.shards()) == 202


def test_training_goes_on_without_the_coordinator_and_a_restarted_one_learns_the_shards_again():
    """The coordinator holds no tensors: with it dead the loop and train_step go on, and a new coordinator on the
    same address hears every shard at its next heartbeat; this client reconnects and deploys again."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with Cluster.local(num_shards=2, timeouts=Timeouts(heartbeat=0.5)) as cluster:
        model = cluster.deploy(net, num_stages=2)
        model.train_step(x, y, "MSELoss", microbatches=2)
        services = cluster._services
        coordinator = services.services[0]
        coordinator.process.kill()
        coordinator.process.wait()
        assert model.train_step(x, y, "MSELoss", microbatches=2) > 0
        nn.functional.mse_loss(model(x), y).backward()
        model.step()
        trained = model.state_dict()
        down = time.monotonic()
        while time.monotonic() < down + 5:  # a script asking all along: grpc's own backoff would grow to seconds
            with pytest.raises(errors.Unavailable, match="coordinator"):
                cluster.shards()
            time.sleep(0.2)
        restarted = services._start("coordinator-restarted",
                                    ["-m", "coordinator", "--bind", f"127.0.0.1:{coordinator.port}"])
        restarted.wait_ready(60)
        ready, answered = time.monotonic(), None
        deadline = ready + 30
        while time.monotonic() < deadline:
            try:
                shards = cluster.shards()
                answered = answered or time.monotonic()
                if len(shards) == 2:
                    break
            except errors.Unavailable:  # the channel is between two reconnection attempts
                pass
            time.sleep(0.02)
        assert answered is not None and answered - ready < 1.0  # reconnected within a second of the new one serving
        assert sorted(s.address for s in cluster.shards()) == sorted(services.shard_addresses)
        assert trains_like_one_process(cluster, num_stages=2) <= 1e-5
    shutil.rmtree(services.log_dir, ignore_errors=True)  # kept by close(): the first coordinator had died, on purpose
    assert set(trained) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_a_live_shard_s_address_cannot_be_registered_by_another_process(own_cluster):
    """A registration for an address a live shard holds is refused unless it comes from the process answering
    there (its instance and its control key); an address where nothing answers any more is free."""
    cluster = own_cluster

    def register(address: str, instance: str, memory: int = 1 << 50) -> None:
        request = coordinator_pb2.RegisterShardRequest(address=address, device="cpu", memory_bytes=memory,
                                                       instance=instance)
        cluster._io.run(cluster._coordinator.call("RegisterShard", request))
    victim = cluster.shards()[0]
    with pytest.raises(errors.AlreadyExists, match=rf"{victim.address} is registered by a live shard"):
        register(victim.address, "rogue")
    with pytest.raises(errors.AlreadyExists):
        register(victim.address, "")
    assert cluster.shards()[0] == victim  # its memory and place as they were

    async def instance_at(address: str) -> str:
        peer = rpc.Peer("victim", address, rpc.SHARD_SERVICE, cluster.security, 10)  # on the client's loop
        try:
            return (await peer.call("Describe", shard_pb2.DescribeRequest())).instance
        finally:
            await peer.close()
    instance = cluster._io.run(instance_at(victim.address))
    # Its instance is no secret (Describe tells it); renewing the registration takes the key only it holds.
    with pytest.raises(errors.PermissionDenied, match="with another control key: only that process renews"):
        register(victim.address, instance, 1 << 50)
    assert cluster.shards()[0] == victim
    register("127.0.0.1:1", "first")  # nothing listens there
    register("127.0.0.1:1", "second")  # so another process may take it
    assert trains_like_one_process(cluster, num_stages=2) <= 1e-5
