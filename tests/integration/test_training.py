"""Training over shards (real processes on 127.0.0.1) matches the same training in one process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from client_sdk import LayerList
from client_sdk.seed_models import TEST_RESIDUAL_SMALL
from tests.integration.training import (SKIP_A_STAGE, largest_difference, regression_batches, train_locally,
                                        train_remotely)

ADAM = (torch.optim.Adam, {"lr": 3e-3})


def test_seed_residual_model_on_three_shards_matches_one_process(cluster4):
    torch.manual_seed(0)
    reference = LayerList(TEST_RESIDUAL_SMALL)
    batches = regression_batches(steps=50, batch=32, features=1)
    model = cluster4.deploy(TEST_RESIDUAL_SMALL, optimizer=ADAM, num_stages=3)
    model.load_state_dict(reference.state_dict())  # the deploy built its own weights; start from the reference's
    losses = train_remotely(model, batches)
    assert largest_difference(model.state_dict(), train_locally(reference, batches, ADAM)) <= 1e-5
    assert losses[-1] < losses[0] / 5, f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}"
    assert [(p.first_layer, p.end_layer) for p in model.placements] == [(0, 3), (3, 5), (5, 10)]


def test_fused_adam_with_its_arguments_on_the_shards_matches_one_process(cluster4):
    # The README's advice for CPU: fused Adam, whose sqrt takes no slow path on zeros. The weight decay
    # shows that the keyword arguments reach every shard's optimizer.
    fused = (torch.optim.Adam, {"lr": 3e-3, "fused": True, "weight_decay": 0.5})
    torch.manual_seed(0)
    reference = LayerList(TEST_RESIDUAL_SMALL)
    batches = regression_batches(steps=20, batch=32, features=1)
    model = cluster4.deploy(TEST_RESIDUAL_SMALL, optimizer=fused, num_stages=3)
    model.load_state_dict(reference.state_dict())
    train_remotely(model, batches)
    assert largest_difference(model.state_dict(), train_locally(reference, batches, fused)) <= 1e-5


@pytest.mark.parametrize("stages", [2, 4])
def test_sequential_matches_one_process(cluster4, stages):
    torch.manual_seed(stages)
    net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16),
                        nn.GELU(), nn.Linear(16, 2))
    batches = regression_batches(steps=30, batch=16, features=6, outputs=2)
    model = cluster4.deploy(net, optimizer=ADAM, num_stages=stages)
    assert len(model.placements) == stages
    train_remotely(model, batches)
    trained = model.state_dict()
    assert list(trained) == list(net.state_dict())
    assert largest_difference(trained, train_locally(net, batches, ADAM)) <= 1e-5


def test_residual_that_skips_a_whole_stage_gets_its_gradient(cluster4):
    torch.manual_seed(1)
    reference = LayerList(SKIP_A_STAGE)
    batches = regression_batches(steps=25, batch=8, features=3)
    model = cluster4.deploy(reference, optimizer=(torch.optim.SGD, {"lr": 0.1}), split_points=[2, 4])
    assert [(p.first_layer, p.end_layer) for p in model.placements] == [(0, 2), (2, 4), (4, 6)]
    train_remotely(model, batches)
    trained, expected = model.state_dict(), train_locally(reference, batches, (torch.optim.SGD, {"lr": 0.1}))
    assert largest_difference(trained, expected) <= 1e-5


CUSTOM_LAYER_SCRIPT = textwrap.dedent('''
    import json, sys, threading, torch
    from torch import nn
    from client_sdk import Cluster

    class Swish(nn.Module):                 # lives in __main__: the shards cannot import it
        def __init__(self, features):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(features))
        def forward(self, x):
            return x * torch.sigmoid(self.scale * x)

    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 16), Swish(16), nn.Linear(16, 16), Swish(16), nn.Linear(16, 1))
    reference = {k: v.clone() for k, v in net.state_dict().items()}
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(20)]
    cluster = Cluster.connect(sys.argv[1])
    model = cluster.deploy(net, optimizer=(torch.optim.SGD, {"lr": 0.05}), num_stages=2)
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward(); model.step(); model.zero_grad()
    trained = model.state_dict()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for x, y in batches:
        nn.functional.mse_loss(net(x), y).backward(); opt.step(); opt.zero_grad()
    print(json.dumps({"difference": max((trained[k] - v).abs().max().item() for k, v in net.state_dict().items()),
                      "moved": max((trained[k] - v).abs().max().item() for k, v in reference.items()),
                      "keys": list(trained), "threads": [t.name for t in threading.enumerate()]}))
    cluster.close()
''')


def test_custom_layer_class_defined_in_main_trains(cluster4, tmp_path):
    script = tmp_path / "custom_layer.py"
    script.write_text(CUSTOM_LAYER_SCRIPT)
    cluster4._close_models()  # this client lets go of its deployment, so that another process may deploy
    done = subprocess.run([sys.executable, str(script), cluster4.address], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "SHARDTRAIN_AUTH_TOKEN": cluster4.security.token})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["difference"] <= 1e-5
    assert result["moved"] > 1e-3
    assert result["keys"] == ["0.weight", "0.bias", "1.scale", "2.weight", "2.bias", "3.scale", "4.weight", "4.bias"]
    assert "shardtrain-io" not in result["threads"], "a script runs the SDK's loop in its own thread"


def test_no_grad_forward_keeps_no_state_and_matches_local(cluster4):
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    model = cluster4.deploy(net, num_stages=2)
    x = torch.randn(5, 3)
    with torch.no_grad():
        pred = model(x)
    assert not pred.requires_grad
    torch.testing.assert_close(pred, net(x).detach(), rtol=0, atol=1e-6)
    reports = model.describe()
    assert all(not report.in_flight_steps for report in reports)
    # Plain data, in stage order: what a person prints, or compares with the placements.
    assert [(r.stage, r.address, r.layer_indexes) for r in reports] == [
        (p.stage, p.shard_address, tuple(range(p.first_layer, p.end_layer))) for p in model.placements]
    assert [r.parameter_count for r in reports] == [3 * 8 + 8, 8 * 2 + 2]
    assert all(r.deployment_id == model.deployment_id and r.device == "cpu" and r.instance for r in reports)
    assert "ShardReport(address=" in repr(reports[0]) and dataclasses.asdict(reports[0])["stage"] == 0
    # Printed, a table: a header, a rule, a row per stage.
    header, rule, *rows = str(reports).splitlines()
    assert header.split()[:3] == ["address", "device", "deployment_id"] and set(rule) <= {"-", " "}
    assert [row.split()[0] for row in rows] == [p.shard_address for p in model.placements]
    shards = cluster4.shards()
    assert str(shards).splitlines()[0].split() == ["shard_id", "address", "device", "memory_bytes", "device_group"]
    assert len(str(shards).splitlines()) == 2 + len(shards) and "shard_id=" not in str(shards)


def test_gradient_accumulation_over_two_forwards(cluster4):
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    model = cluster4.deploy(net, optimizer=(torch.optim.SGD, {"lr": 0.1}), num_stages=2)
    batches = regression_batches(steps=2, batch=4, features=3)
    total = sum(nn.functional.mse_loss(model(x), y) for x, y in batches)
    total.backward()
    model.step()
    local_total = sum(nn.functional.mse_loss(net(x), y) for x, y in batches)
    local_total.backward()
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    assert largest_difference(model.state_dict(), net.state_dict()) <= 1e-6


def test_layers_per_stage_decides_the_cut(cluster4):
    net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model = cluster4.deploy(net, layers_per_stage=[1, 3, 1])
    assert [(p.first_layer, p.end_layer) for p in model.placements] == [(0, 1), (1, 4), (4, 5)]
    assert len({p.shard_address for p in model.placements}) == 3
    train_remotely(model, regression_batches(steps=2, batch=4, features=2))


def test_gradients_flow_back_into_a_client_side_layer(cluster4):
    torch.manual_seed(6)
    front = nn.Linear(3, 4)                       # stays in this process
    net = nn.Sequential(nn.Tanh(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    local_front, local_net = nn.Linear(3, 4), nn.Sequential(nn.Tanh(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    local_front.load_state_dict(front.state_dict())
    local_net.load_state_dict(net.state_dict())
    model = cluster4.deploy(net, optimizer=(torch.optim.SGD, {"lr": 0.1}), num_stages=2,
                            example_input=torch.randn(2, 4))
    front_opt = torch.optim.SGD(front.parameters(), lr=0.1)
    local_opt = torch.optim.SGD([*local_front.parameters(), *local_net.parameters()], lr=0.1)
    for x, y in regression_batches(steps=5, batch=4, features=3):
        nn.functional.mse_loss(model(front(x)), y).backward()
        front_opt.step(), model.step()
        front_opt.zero_grad(), model.zero_grad()
        nn.functional.mse_loss(local_net(local_front(x)), y).backward()
        local_opt.step()
        local_opt.zero_grad()
    assert largest_difference(front.state_dict(), local_front.state_dict()) <= 1e-6
    assert largest_difference(model.state_dict(), local_net.state_dict()) <= 1e-6


@pytest.mark.parametrize("ends_with_step", [True, False])
def test_an_optimizer_step_that_lists_a_backward_reports_its_end_in_place_of_the_first_stage(cluster4,
                                                                                             ends_with_step):
    """In the PyTorch-shaped loop model.step() follows loss.backward() at once, so the optimizer step reaches
    the first stage before that stage's backward is over. The step's settling then tells the SDK that the
    backward is over, and the first stage sends no backward_done item: one item and one wake-up of the SDK
    less per step. A sender that does not say so (an SDK of before) still gets backward_done."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))
    model = cluster4.deploy(net, optimizer=ADAM, num_stages=3)
    clients, links = model._clients, model._clients._links
    received = []
    on_item = links._on_item  # the SDK's handler of what comes back; its links open at the first forward

    def recording(end, message, tensor):
        received.append(message.WhichOneof("item"))
        on_item(end, message, tensor)
    links._on_item = recording
    x = torch.randn(8, 6)

    async def steps():
        for step in range(3):
            output, _ = await clients.forward(step, x, requires_grad=True, zero_grad=True, after_optimizer_step=step)
            request = clients.step_request(step, False, step + 1, [step])
            request.backwards_end_with_step = ends_with_step
            settled = clients.step(request)
            await asyncio.sleep(0.2)  # the step is at the first stage long before the gradient is sent
            backward = asyncio.ensure_future(clients.backward(step, torch.ones_like(output)))
            await clients.flush()  # the step settles (no later forward will say so), and with it the backward
            await asyncio.wait_for(asyncio.gather(backward, settled), 30)
    model._io.run(steps())
    assert received.count("output") == 3
    assert received.count("backward_done") == (0 if ends_with_step else 3)
    trained = model.state_dict()
    assert all(torch.isfinite(value).all() for value in trained.values())
