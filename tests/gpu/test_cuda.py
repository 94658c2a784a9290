"""Shards on CUDA: the same training as on the CPU, within float tolerance. Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from client_sdk import Cluster
from examples.gpt import GPT, GPTConfig
from shard_service.replicas import GradientAverager
from tests.integration.test_pipeline import train_full_batch
from tests.integration.training import largest_difference, regression_batches, train_locally, train_remotely

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_sequential_on_cuda_shards_matches_one_process():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    batches = regression_batches(steps=20, batch=32, features=8)
    adam = (torch.optim.Adam, {"lr": 1e-3})
    with Cluster.local(num_shards=2, device="cuda") as cluster:
        model = cluster.deploy(net, optimizer=adam)
        assert all(report.device == "cuda" for report in model.describe())
        train_remotely(model, batches)
        trained = model.state_dict()
    assert all(tensor.device.type == "cpu" for tensor in trained.values())
    assert largest_difference(trained, train_locally(net, batches, adam)) <= 1e-4


def test_cuda_tensors_are_staged_through_pinned_memory_chunk_by_chunk():
    from shardtrain import wire
    original = torch.randn(3 << 20, device="cuda")  # 12 MiB: 12 chunks of 1 MiB
    frames = list(wire.tensor_frames(original, "t"))
    assert len(frames) == 12
    received = next(wire.read_tensors(frames))[1]
    assert received.device.type == "cpu" and torch.equal(received, original.cpu())


def test_pipelined_train_step_on_cuda_shards_matches_one_process():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    batches = regression_batches(steps=10, batch=32, features=8)
    sgd = (torch.optim.SGD, {"lr": 0.05})
    with Cluster.local(num_shards=2, device="cuda") as cluster:
        model = cluster.deploy(net, optimizer=sgd)
        for x, y in batches:
            model.train_step(x, y, "MSELoss", microbatches=4)
        trained = model.state_dict()
    assert largest_difference(trained, train_locally(net, batches, sgd)) <= 1e-4


def test_a_gpt_computing_its_loss_on_cuda_shards_trains_as_one_process_and_registers_gpu_memory():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=13, block_size=12, n_layer=4, n_head=2, n_embd=16)
    local = GPT(config)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 13, (8, 12), generator=generator), torch.randint(0, 13, (8, 12), generator=generator))
               for _ in range(5)]
    with Cluster.local(num_shards=3, device="cuda") as cluster:
        total = torch.cuda.get_device_properties(0).total_memory
        assert all(shard.memory_bytes == total for shard in cluster.shards())
        model = cluster.deploy(copy.deepcopy(local), optimizer=(torch.optim.SGD, {"lr": 0.1}),
                               example_inputs=batches[0])
        optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
        for x, y in batches:
            model(x, y)[1].backward()
            model.step()
            model.zero_grad()
            local(x, y)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
        trained = model.state_dict()
    assert largest_difference(trained, local.state_dict()) <= 1e-4


@pytest.mark.parametrize("tcp", ["on", "off"])
def test_between_hosts_paths_carry_cuda_tensors_and_training_matches_one_process(monkeypatch, tcp):
    """Shared memory off, as on separate machines: CUDA activations and gradients go through pinned staging
    onto the Links' TCP sockets (or their gRPC streams with --tcp-links off)."""
    monkeypatch.setenv("SHARDTRAIN_SHARED_MEMORY", "off")
    monkeypatch.setenv("SHARDTRAIN_TCP_LINKS", tcp)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    batches = regression_batches(steps=6, batch=4096, features=8)  # 4 MiB activations: several chunks
    adam = (torch.optim.Adam, {"lr": 1e-3})
    expected, expected_losses = train_full_batch(net, batches, adam)
    with Cluster.local(num_shards=3, device="cuda") as cluster:
        model = cluster.deploy(net, optimizer=adam, num_stages=3)
        losses = [model.train_step(x, y, "MSELoss", microbatches=4) for x, y in batches]
        trained = model.state_dict()
    assert losses == pytest.approx(expected_losses, rel=1e-4)
    assert largest_difference(trained, expected) <= 1e-4


def test_two_replicas_on_one_gpu_sum_gradients_through_gloo_and_match_one_process():
    """NCCL refuses two ranks on one GPU, so replicas that share a GPU fall back to gloo on CUDA tensors."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    batches = regression_batches(steps=6, batch=22, features=4)
    adam = (torch.optim.Adam, {"lr": 3e-3})
    expected, expected_losses = train_full_batch(net, batches, adam)
    with Cluster.local(num_shards=4, device="cuda") as cluster:
        model = cluster.deploy(net, optimizer=adam, num_stages=2, replicas=2)
        losses = [model.train_step(x, y, "MSELoss", microbatches=2) for x, y in batches]
        assert {s["allreduce_backend"] for s in model.stats()} == {"gloo"}
        trained = model.state_dict()
    assert losses == pytest.approx(expected_losses, rel=1e-4)
    assert largest_difference(trained, expected) <= 1e-4


def test_a_stage_whose_replicas_each_have_a_gpu_sums_gradients_with_nccl():
    """The NCCL path of the averager, at the one replica a one-GPU machine can give it: the group forms
    through the store, buckets go out from the gradient hooks during backward, and the sums are written back."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(512, 2048), nn.Linear(2048, 1024)).cuda()  # 12 MiB of gradients: 3 buckets
    parameters = list(layer.parameters())
    averager = GradientAverager(0, 1, "", "127.0.0.1", parameters, timeout=60.0)
    try:
        assert averager.connect() == "nccl"
        averager.arm(True)
        layer(torch.randn(16, 512, device="cuda")).square().mean().backward()
        expected = [p.grad.clone() for p in parameters]
        averager.finish()
        assert all(torch.equal(p.grad, e) for p, e in zip(parameters, expected))
    finally:
        averager.close()


def test_transformers_gpt2_and_llama_on_cuda_shards_train_as_one_process():
    pytest.importorskip("transformers")
    from tests.integration.test_library_models import build, deploy, train_in_the_loop, train_locally
    for name in ("gpt2", "llama"):
        local, batches = build(name)
        with Cluster.local(num_shards=4, device="cuda") as cluster:
            remote = deploy(cluster, copy.deepcopy(local), batches)
            assert len({p.shard_address for p in remote.placements}) == 4
            assert all(report.device == "cuda" for report in remote.describe())
            losses = train_in_the_loop(remote, batches, remote)
            state = remote.state_dict()
        assert losses == pytest.approx(train_locally(local, batches), abs=1e-4), name
        assert largest_difference(state, local.state_dict()) <= 1e-4, name
