"""The tensor transport between real processes: integrity, resumed streams, shared memory, compression."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import zlib

import pytest
import torch
from torch import nn

from client_sdk import Cluster
from shardtrain import errors, rpc, shm
from shardtrain.codec import Frame
from shardtrain.settings import Security
from shardtrain.v1 import shard_pb2, tensor_pb2
from tests.integration.flaky_fetch_server import BREAK_AFTER, CHUNK_BYTES, TENSOR
from tests.integration.training import largest_difference, regression_batches, train_locally, train_remotely

ADAM = (torch.optim.Adam, {"lr": 1e-2})


def small_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def segments_of(pids) -> list[str]:
    return [str(p) for pid in pids for p in pathlib.Path(shm.DIRECTORY).glob(f"shardtrain-{pid}-*")]


def test_a_corrupted_chunk_is_data_loss_and_the_shard_serves_on(cluster4):
    model = cluster4.deploy(small_net(), optimizer=ADAM, num_stages=2)
    shard = model._clients.stages[0]
    data = torch.randn(4, 8).numpy().tobytes()
    header = shard_pb2.ForwardHeader(key=shard_pb2.StepKey(deployment_id=model.deployment_id, step=10_000))
    chunk = tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(
        name="activation", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4, 8], nbytes=128, wire_nbytes=128),
        crc32=zlib.crc32(data) ^ 1)
    request = Frame(shard_pb2.ForwardRequest(header=header, tensor=chunk), data)
    with pytest.raises(errors.DataLoss, match=r"'activation'.*CRC-32"):
        model._io.run(shard.call("Forward", iter([request])))
    train_remotely(model, regression_batches(steps=2, batch=4, features=8))  # the next steps work


@pytest.mark.parametrize("shared_memory", ["on", "off"])
def test_with_checksums_on_every_path_checks_its_chunks_and_training_matches(monkeypatch, shared_memory):
    """SHARDTRAIN_CHECKSUMS=on: the SDK's chunks and the shards' (--checksums on) carry a CRC-32 that each receiver
    checks, on the same-host and the between-hosts paths."""
    monkeypatch.setenv("SHARDTRAIN_CHECKSUMS", "on")
    monkeypatch.setenv("SHARDTRAIN_SHARED_MEMORY", shared_memory)
    batches = regression_batches(steps=4, batch=16, features=8)
    with Cluster.local(num_shards=2) as cluster:
        model = cluster.deploy(small_net(), optimizer=ADAM, num_stages=2)
        assert model._clients._checksums
        train_remotely(model, batches)
        assert largest_difference(model.state_dict(), train_locally(small_net(), batches, ADAM)) < 1e-5


def test_a_broken_fetch_stream_resumes_from_the_last_good_offset():
    server = subprocess.Popen([sys.executable, "-m", "tests.integration.flaky_fetch_server"],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(server.stdout.readline())["port"]

        async def fetch():
            peer = rpc.Peer("flaky shard", f"127.0.0.1:{port}", rpc.SHARD_SERVICE, Security(), timeout=30)
            try:
                return await rpc.fetch_tensor(peer, shard_pb2.StepKey(step=1), "residual")
            finally:
                await peer.close()
        received = asyncio.run(fetch())
        assert torch.equal(received, TENSOR)
    finally:
        server.kill()
        output, _ = server.communicate()
    offsets = [json.loads(line)["offset"] for line in output.splitlines()]
    assert offsets == [0, BREAK_AFTER * CHUNK_BYTES]  # the second request resumed where the first broke


@pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")
def test_same_host_shards_train_through_shared_memory_and_match_one_process(cluster4):
    net = small_net()
    batches = regression_batches(steps=5, batch=512, features=8)  # 512x64 floats: 128 KiB activations
    expected = train_locally(small_net(), batches, ADAM)
    model = cluster4.deploy(net, optimizer=ADAM, num_stages=3)
    train_remotely(model, batches)
    assert largest_difference(model.state_dict(), expected) < 1e-5
    assert segments_of(cluster4._services.pids)  # the activations went through segments


@pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")
def test_segments_are_gone_after_a_shard_is_sigkilled(own_cluster):
    model = own_cluster.deploy(small_net(), optimizer=ADAM, num_stages=2)
    train_remotely(model, regression_batches(steps=2, batch=512, features=8))
    victim = next(s for s in own_cluster._services.services if s.address == model.placements[0].shard_address)
    assert segments_of([victim.process.pid])
    victim.process.kill()
    victim.process.wait()
    pids = own_cluster._services.pids
    own_cluster.close()
    assert not segments_of(pids)


@pytest.mark.parametrize(("compression", "tolerance"), [("bf16", 0.05), ({"activations": "int8"}, 0.1)])
def test_compressed_training_follows_exact_training(cluster4, compression, tolerance):
    batches = regression_batches(steps=20, batch=64, features=8)
    exact = train_remotely(cluster4.deploy(small_net(), optimizer=ADAM, num_stages=2), batches)
    compressed = train_remotely(cluster4.deploy(small_net(), optimizer=ADAM, num_stages=2,
                                                compression=compression), batches)
    assert compressed != exact  # the wire really was lossy
    assert abs(compressed[-1] - exact[-1]) <= tolerance * exact[0]


def test_an_unknown_compression_is_refused_before_deploying(cluster4):
    with pytest.raises(errors.InvalidArgument, match="unknown wire encoding 'fp8'"):
        cluster4.deploy(small_net(), compression="fp8")
