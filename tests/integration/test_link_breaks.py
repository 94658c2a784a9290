"""A link between two live stages breaks while an optimizer step travels on it.

Stage 1 is reached through a TCP proxy (tests/integration/tcp_proxy.py), and stage 0 keeps its Link items on
the gRPC stream (--local-links off), so the proxy carries everything stage 0 sends stage 1. The proxy holds
back what stage 0 sends once the step's forward is through, then drops the connections: stage 0 has applied
the step, and its verdict, on its way to stage 1, is lost. Neither stage goes away.
"""

from __future__ import annotations

import contextlib
import shutil
import time

import pytest
import torch
from torch import nn

from client_sdk import Cluster
from client_sdk.processes import LocalServices
from shardtrain import errors
from tests.integration.tcp_proxy import TcpProxy
from tests.integration.training import regression_batches, train_locally, train_remotely

ADAM = (torch.optim.Adam, {"lr": 0.01})


@contextlib.contextmanager
def stage_one_behind_a_proxy():
    """A coordinator and 3 shards, registered in stage order; stage 1 is reached through the proxy."""
    services = LocalServices(0)
    proxy = TcpProxy()
    try:
        services.add_shard(["--local-links", "off"])
        proxied = services.add_shard(["--advertise", proxy.address])
        proxy.forward_to(f"127.0.0.1:{proxied.port}")
        services.add_shard()
        with Cluster(services.coordinator_address, services=services) as cluster:
            cluster.wait_for_shards(3, 120.0)
            yield cluster, proxy
    finally:
        proxy.close()
        services.stop()
        shutil.rmtree(services.log_dir, ignore_errors=True)


def optimizer_steps(model, stage: int) -> int:
    """How many optimizer steps stage `stage` has applied (Adam's step count)."""
    state = model._io.run(model._clients.stage_optimizer_state(stage))
    counts = [value for key, value in state.tensors.items() if key.endswith("/step")]
    return int(counts[0]) if counts else 0


def test_an_optimizer_step_reaches_every_stage_when_the_link_carrying_it_breaks():
    with stage_one_behind_a_proxy() as (cluster, proxy):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1))
        model = cluster.deploy(net, optimizer=ADAM, split_points=[1, 2])
        assert model.placements[1].shard_address == proxy.address
        batches = regression_batches(steps=5, batch=4, features=3)
        train_remotely(model, batches[:2])

        x, y = batches[2]
        pred = model(x)  # through every stage: from here on, nothing stage 0 sends reaches stage 1
        proxy.hold()
        torch.nn.functional.mse_loss(pred, y).backward()
        model.step()
        deadline = time.monotonic() + 30
        while optimizer_steps(model, 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert optimizer_steps(model, 0) == 3, "stage 0 applied the step (and sent its verdict)"
        time.sleep(0.5)
        assert proxy.held_bytes > 0
        proxy.drop()

        with pytest.raises(errors.ShardtrainError):
            model.synchronize()  # the SDK hears that the link broke
        # Stage 0 opens its link to stage 1 again at once, and sends its last verdicts first: stages 1 and 2 apply
        # the step without waiting for the next forward.
        deadline = time.monotonic() + 30
        while [optimizer_steps(model, stage) for stage in range(3)] != [3, 3, 3] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [optimizer_steps(model, stage) for stage in range(3)] == [3, 3, 3]
        model.zero_grad()
        train_remotely(model, batches[3:])  # over the new link, through the proxy
        trained = model.state_dict()  # once everything sent has settled
        assert [optimizer_steps(model, stage) for stage in range(3)] == [5, 5, 5], \
            "every stage applied the step that stage 0 applied, once"
        expected = train_locally(net, batches, ADAM)
        for key, value in expected.items():
            assert torch.allclose(trained[key], value, atol=1e-6, rtol=0), key


def test_a_link_that_breaks_between_steps_fails_no_later_step():
    """Both stages report the break to the SDK, which reads the reports only when it next runs: in the next step's
    forward. That step travels on a new link, and the reports, which name the last step the link may have cost,
    must not fail it."""
    with stage_one_behind_a_proxy() as (cluster, proxy):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1))
        model = cluster.deploy(net, optimizer=ADAM, split_points=[1, 2])
        batches = regression_batches(steps=5, batch=4, features=3)
        train_remotely(model, batches[:2])
        model.synchronize()
        proxy.drop()
        time.sleep(1.0)  # the reports wait in the SDK's sockets: nobody runs its loop between calls
        train_remotely(model, batches[2:])
        trained = model.state_dict()
        assert [optimizer_steps(model, stage) for stage in range(3)] == [5, 5, 5]
        expected = train_locally(net, batches, ADAM)
        for key, value in expected.items():
            assert torch.allclose(trained[key], value, atol=1e-6, rtol=0), key
