"""Shards started with --flush-denormal on (Cluster.local(flush_denormal=True)) compute with denormals as zero."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from client_sdk import Cluster, LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL
from tests.integration.training import largest_difference, regression_batches, train_locally, train_remotely

ADAM = (torch.optim.Adam, {"lr": 3e-3})


@pytest.fixture(scope="module")
def flushing():
    with Cluster.local(num_shards=2, flush_denormal=True) as cluster:
        yield cluster


def _tiny_products(features: int) -> nn.Sequential:
    """One bias-free Linear whose products with an input of 1e-20 are 1e-43 each: denormal floats."""
    net = nn.Sequential(nn.Linear(features, features, bias=False))
    with torch.no_grad():
        net[0].weight.fill_(1e-23)
    return net


def test_a_small_forward_on_the_event_loop_flushes_denormals(flushing, cluster4):
    x = torch.full((4, 8), 1e-20)
    for cluster, flushed in ((flushing, True), (cluster4, False)):
        model = cluster.deploy(_tiny_products(8), num_stages=1)
        with torch.no_grad():
            out = model(x)
        assert [report.flush_denormal for report in model.describe()] == [flushed]
        if flushed:
            assert torch.count_nonzero(out) == 0, f"denormal outputs were not flushed: {out[0, :4].tolist()}"
        else:  # torch's default: 8 products of 1e-43 add up to a denormal, not to zero
            assert torch.all((out > 0) & (out < torch.finfo(torch.float32).tiny))


def test_a_long_forward_on_the_compute_thread_and_its_intra_op_threads_flushes_denormals(flushing):
    # Work that takes more than a few milliseconds runs on the shard's compute thread, and the shard tries it
    # on one intra-op thread and on all (shard_service/threads.py): every call, on either count, flushes.
    model = flushing.deploy(_tiny_products(2048), num_stages=1)
    x = torch.full((256, 2048), 1e-20)
    with torch.no_grad():
        for call in range(14):
            out = model(x)
            assert torch.count_nonzero(out) == 0, f"call {call}: {torch.count_nonzero(out)} outputs not flushed"


def test_training_on_flushing_shards_matches_one_flushing_process(flushing):
    torch.manual_seed(0)
    reference = LayerList(TEST_RESIDUAL_SMALL)
    batches = regression_batches(steps=20, batch=32, features=1)
    model = flushing.deploy(TEST_RESIDUAL_SMALL, optimizer=ADAM, num_stages=2)
    model.load_state_dict(reference.state_dict())
    losses = train_remotely(model, batches)
    torch.set_flush_denormal(True)
    try:
        expected = train_locally(reference, batches, ADAM)
    finally:
        torch.set_flush_denormal(False)
    assert largest_difference(model.state_dict(), expected) <= 1e-5
    assert losses[-1] < losses[0]
