"""The tensor transport between real processes: integrity, resumed streams, shared memory, compression."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import time
import zlib

import crc32c
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


@pytest.mark.parametrize("kind", ["crc32", "crc32c"])
def test_a_corrupted_chunk_is_data_loss_and_the_shard_serves_on(cluster4, kind):
    model = cluster4.deploy(small_net(), optimizer=ADAM, num_stages=2)
    shard = model._clients.stages[0]
    data = torch.randn(4, 8).numpy().tobytes()
    header = shard_pb2.ForwardHeader(key=shard_pb2.StepKey(deployment_id=model.deployment_id, step=10_000))
    chunk = tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(
        name="activation", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4, 8], nbytes=128, wire_nbytes=128))
    setattr(chunk, kind, (crc32c.crc32c(data) if kind == "crc32c" else zlib.crc32(data)) ^ 1)
    request = Frame(shard_pb2.ForwardRequest(header=header, tensor=chunk), data)
    with pytest.raises(errors.DataLoss, match=rf"'activation'.*{'CRC-32C' if kind == 'crc32c' else 'CRC-32'} check"):
        model._io.run(shard.call("Forward", iter([request])))
    train_remotely(model, regression_batches(steps=2, batch=4, features=8))  # the next steps work


def header_only(message_type, header, name: str, shape: list[int]):
    """A request stream whose tensor's header declares `shape` (float32) and whose data never comes."""
    nbytes = 4
    for dim in shape:
        nbytes *= dim
    chunk = tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(
        name=name, dtype=tensor_pb2.DTYPE_FLOAT32, shape=shape, nbytes=nbytes, wire_nbytes=nbytes))

    async def frames():
        yield Frame(message_type(header=header, tensor=chunk), b"")
        await asyncio.sleep(3600)  # the data would follow: the shard must not wait for it
    return frames()


def test_a_tensor_the_stage_would_not_take_is_refused_by_its_header_before_any_data(cluster4):
    model = cluster4.deploy(small_net(), optimizer=ADAM, num_stages=2)
    first, last = model._clients.stages
    deployment = model.deployment_id
    key = shard_pb2.StepKey(deployment_id=deployment, step=10_000)
    tebibyte = [1 << 20, 1 << 18]  # 1 TiB of float32
    refusals = [
        (first, "LoadState", shard_pb2.LoadStateRequest, shard_pb2.LoadStateHeader(deployment_id=deployment),
         "0.weight", tebibyte, errors.InvalidArgument, r"'0.weight': expected torch.float32 of shape \[64, 8\], got"),
        (first, "LoadState", shard_pb2.LoadStateRequest, shard_pb2.LoadStateHeader(deployment_id=deployment),
         "2.weight", [64, 64], errors.InvalidArgument, "stage 0 has no weight '2.weight'"),
        (first, "LoadOptimizerState", shard_pb2.OptimizerStateMessage,
         shard_pb2.OptimizerStateHeader(deployment_id=deployment), "2.weight/exp_avg", [64, 64],
         errors.InvalidArgument, "optimizer state '2.weight/exp_avg' names no parameter of stage 0"),
        (first, "LoadOptimizerState", shard_pb2.OptimizerStateMessage,
         shard_pb2.OptimizerStateHeader(deployment_id=deployment), "0.weight/exp_avg", tebibyte,
         errors.InvalidArgument, r"of shape \[1048576, 262144\] is larger than its parameter \[64, 8\]"),
        (first, "Forward", shard_pb2.ForwardRequest, shard_pb2.ForwardHeader(key=key), "activation", [4, 9],
         errors.InvalidArgument, r"stage 0 input \(layer 0\): expected float32 of shape \[batch, 8\]"),
        (last, "Backward", shard_pb2.BackwardRequest, shard_pb2.BackwardHeader(key=key), "gradient", tebibyte,
         errors.ResourceExhausted, "more than a stage on this shard may hold"),
    ]
    for stage, method, message_type, header, name, shape, error, message in refusals:
        started = time.monotonic()
        with pytest.raises(error, match=message):
            model._io.run(stage.call(method, header_only(message_type, header, name, shape)))
        assert time.monotonic() - started < 5, method
    train_remotely(model, regression_batches(steps=2, batch=4, features=8))  # both shards serve on


@pytest.mark.parametrize("shared_memory", ["on", "off"])
def test_with_checksums_on_every_path_checks_its_chunks_and_training_matches(monkeypatch, shared_memory):
    """SHARDTRAIN_CHECKSUMS=on: the SDK's chunks and the shards' (--checksums on) carry a CRC-32C that each
    receiver checks, on the same-host and the between-hosts paths."""
    monkeypatch.setenv("SHARDTRAIN_CHECKSUMS", "on")
    monkeypatch.setenv("SHARDTRAIN_SHARED_MEMORY", shared_memory)
    batches = regression_batches(steps=4, batch=16, features=8)
    with Cluster.local(num_shards=2) as cluster:
        model = cluster.deploy(small_net(), optimizer=ADAM, num_stages=2)
        assert model._clients._checksums == "crc32c"
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
