"""Shards on hosts of their own: each in a network namespace with its own /dev/shm, joined by veth pairs
on a bridge (bench/namespaces.py), so every Link runs the path between hosts over real, distinct addresses."""

from __future__ import annotations

import pytest
import torch

from bench.namespaces import SeparateHosts, unavailable
from client_sdk import Cluster, LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL
from tests.integration.test_local_links import tcp_listeners
from tests.integration.test_pipeline import train_full_batch
from tests.integration.training import largest_difference, regression_batches, train_locally, train_remotely

REASON = unavailable()
pytestmark = pytest.mark.skipif(bool(REASON), reason=REASON or "")
ADAM = (torch.optim.Adam, {"lr": 3e-3})


@pytest.fixture(scope="module")
def hosts():
    with SeparateHosts(3) as made:
        yield made


@pytest.mark.parametrize("tcp", ["on", "off"])
def test_the_seed_model_trains_across_hosts_as_one_process(monkeypatch, hosts, tcp):
    """Its residual crosses stages. With TCP links (the default) each stage's shard listens on a second port for
    the Links its peers open; with --tcp-links off every item stays on the gRPC streams."""
    monkeypatch.setenv("SHARDTRAIN_TCP_LINKS", tcp)
    torch.manual_seed(0)
    reference = LayerList(TEST_RESIDUAL_SMALL)
    batches = regression_batches(steps=6, batch=30, features=1)
    with Cluster.local(num_shards=3, hosts=hosts) as cluster:
        assert sorted(shard.address.rsplit(":", 1)[0] for shard in cluster.shards()) == [
            hosts.shard_host(i) for i in range(3)]
        model = cluster.deploy(TEST_RESIDUAL_SMALL, optimizer=ADAM, num_stages=3)
        model.load_state_dict(reference.state_dict())
        losses = [model.train_step(x, y, "MSELoss", microbatches=3) for x, y in batches]
        listeners = [tcp_listeners(service.process.pid) for service in cluster._services.services[1:]]
        trained = model.state_dict()
        loop_model = cluster.deploy(TEST_RESIDUAL_SMALL, optimizer=ADAM, num_stages=3)
        loop_model.load_state_dict(reference.state_dict())
        train_remotely(loop_model, batches)
        loop_trained = loop_model.state_dict()
    expected, expected_losses = train_full_batch(reference, batches, ADAM)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert largest_difference(trained, expected) <= 1e-5
    assert largest_difference(loop_trained, train_locally(reference, batches, ADAM)) <= 1e-5
    assert listeners == ([2, 2, 2] if tcp == "on" else [1, 1, 1])
